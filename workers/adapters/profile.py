"""``profile`` runs: the profile engine over the run's pinned dataset version."""

from __future__ import annotations

from workers.adapters.common import ApiReporter
from workers.client import WorkerSession
from workers.profile.engine import run_profile
from workers.storage import default_store


def run(session: WorkerSession) -> None:
    """Profile, store the report, and make it the run's report."""
    store = default_store()
    _, uri = run_profile(run=session.run.model_dump(mode="json"), store=store,
                         sink=ApiReporter(session, store))
    session.set_report(uri)
