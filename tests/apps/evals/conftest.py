"""An arithmetic environment version (QC pending: eval runs may use it) for suite entries."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services


@pytest.fixture
def arith(project):
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="arith")
    version, _ = env_services.version_create(actor=Actor.system(), environment=env, spec={
        "env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}})
    return version
