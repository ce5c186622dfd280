"""The data behind the compare page, as one read: each run's metric series overlaid by name,
the flattened config with the keys that differ, and the reports side by side with
regressions marked (``GET /api/v1/teams/<team>/runs/compare``, the SDK's ``compare_runs``).
"""

from __future__ import annotations

import uuid
from typing import Any

from apps.core.exceptions import InvalidInput, NotFound
from apps.metrics import selectors as metric_selectors
from apps.runs import dashboard, selectors
from apps.runs.models import Run
from apps.teams.models import Team


def run_ids(values: list[str]) -> list[uuid.UUID]:
    """The requested run ids, in order, each once; a malformed one is a 400 naming it."""
    out: list[uuid.UUID] = []
    for raw in values:
        for part in (p.strip() for p in raw.split(",")):
            if not part:
                continue
            try:
                value = uuid.UUID(part)
            except ValueError as exc:
                raise InvalidInput(f"run {part[:60]!r} is not a run id.",
                                   details={"run": [part[:60]]}) from exc
            if value not in out:
                out.append(value)
    if not out:
        raise InvalidInput("Name the runs to compare: ?run=<id>&run=<id> (1 to "
                           f"{dashboard.MAX_COMPARE}).", details={"run": ["required"]})
    if len(out) > dashboard.MAX_COMPARE:
        raise InvalidInput(f"At most {dashboard.MAX_COMPARE} runs can be compared; got "
                           f"{len(out)}.", details={"run": [f"{len(out)} runs"]})
    return out


def _value(value: Any) -> Any:
    return None if value is dashboard.MISSING else value


def compare(*, team: Team, ids: list[uuid.UUID], names: list[str] | None, max_points: int,
            all_keys: bool = False) -> dict[str, Any]:
    """Runs of ``team`` only: an id of another team's run is the same 404 as a missing one."""
    found = {r.pk: r for r in selectors.runs_with_relations(
        Run.objects.filter(team=team, pk__in=ids))}
    missing = [str(i) for i in ids if i not in found]
    if missing:
        raise NotFound(f"No run '{missing[0]}' in team '{team.slug}'.")
    runs = [found[i] for i in ids]
    keys = [str(r.pk) for r in runs]

    available = {str(r.pk): metric_selectors.metric_names(r.pk) for r in runs}
    wanted = names or sorted(set().union(*available.values()))
    series = []
    for name in wanted:
        per_run = {key: metric_selectors.series(run.pk, name, max_points=max_points)
                   for key, run in zip(keys, runs, strict=True) if name in available[key]}
        series.append({"name": name, "runs": per_run})

    config_rows = dashboard.config_table([r.config for r in runs])
    shown = [row for row in config_rows if all_keys or row.differs]
    reports = [selectors.report_or_none(r) for r in runs]
    report_rows = dashboard.report_table(reports) if any(reports) else []
    baseline = next((k for k, rep in zip(keys, reports, strict=True) if rep), None)
    return {
        "runs": [{"id": str(r.pk), "name": r.name, "kind": r.kind, "status": r.status,
                  "created_at": r.created_at.isoformat()} for r in runs],
        "metrics": {"max_points": max_points, "names": wanted, "series": series},
        "config": {
            "keys": len(config_rows), "differing": sum(row.differs for row in config_rows),
            "rows": [{"key": row.key, "differs": row.differs,
                      "values": {k: _value(v) for k, v in zip(keys, row.values, strict=True)
                                 if v is not dashboard.MISSING}} for row in shown],
        },
        "reports": {
            "baseline": baseline,
            "rows": [{"key": row.key,
                      "values": {k: _value(c.value) for k, c in zip(keys, row.cells, strict=True)
                                 if c.value is not dashboard.MISSING},
                      "regressions": [k for k, c in zip(keys, row.cells, strict=True)
                                      if c.regression],
                      "improvements": [k for k, c in zip(keys, row.cells, strict=True)
                                       if c.improvement]} for row in report_rows],
        },
    }
