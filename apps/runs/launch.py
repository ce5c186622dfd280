"""The one way to launch a run: the API, the launch page, the environment pages and API, and
the test factories all come through :func:`run_launch`, so a preview and a create validate
alike and every run is created by the same transaction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apps.core.actor import Actor
from apps.runs import services
from apps.runs.models import Run
from apps.runs.validation import RunPlan, plan_run
from apps.teams.models import Team


@dataclass(frozen=True)
class Launch:
    """What a launch resolved to; ``run`` is None for a preview."""

    plan: RunPlan
    run: Run | None = None

    def describe(self) -> dict[str, Any]:
        return self.plan.describe()


def run_launch(*, actor: Actor, team: Team, document: dict[str, Any],
               preview: bool = False) -> Launch:
    """Validate ``document`` (the keyword fields of :func:`plan_run`) and, unless
    ``preview``, create the queued run; raises InvalidInput naming the first bad field."""
    plan = plan_run(team=team, **document)
    if preview:
        return Launch(plan=plan)
    return Launch(plan=plan, run=services.create_run(actor=actor, team_id=team.pk, plan=plan))
