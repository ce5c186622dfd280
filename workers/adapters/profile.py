"""``profile`` runs: the profile engine over the run's pinned dataset version."""

from __future__ import annotations

from typing import Any

from workers.client import WorkerSession
from workers.profile.engine import run_profile
from workers.storage import default_store


class ApiSink:
    """Engine progress → API calls on the claimed run."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.session.log_metrics([{"name": k, "step": step, "value": v}
                                  for k, v in values.items()])

    def event(self, message: str, data: dict[str, Any] | None = None) -> None:
        self.session.log_event(message, data=data)

    def should_stop(self) -> bool:
        return self.session.should_stop


def run(session: WorkerSession) -> None:
    """Profile, store the report, and make it the run's report."""
    _, uri = run_profile(run=session.run.model_dump(mode="json"), store=default_store(),
                         sink=ApiSink(session))
    session.set_report(uri)
