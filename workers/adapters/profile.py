"""``profile`` runs: the profile engine over the run's pinned dataset version."""

from __future__ import annotations

from workers.adapters.common import ApiReporter
from workers.client import WorkerSession
from workers.profile.engine import run_profile
from workers.profile.spec import ProfileConfig
from workers.storage import default_store, run_key


def run(session: WorkerSession) -> None:
    """Profile the version the config names (else the one pinned), store the report, and make
    it the run's report."""
    store = default_store()
    config = ProfileConfig.model_validate(session.run.config)
    alias = config.dataset or next(iter(session.run.datasets))
    _, uri = run_profile(config=config, pinned=session.run.datasets[alias], store=store,
                         key=run_key(session.run, "profile.json"),
                         sink=ApiReporter(session, store))
    session.set_report(uri)
