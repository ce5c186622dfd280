from tests.workers.envs.conftest import sandbox  # noqa: F401 - the shared session fixture
