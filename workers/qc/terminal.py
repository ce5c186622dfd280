"""QC of terminal tasks: can a task's hidden tests be trusted as a reward?

Per task, every check plays a script in a fresh session forked from the task's prepared
workspace and grades it exactly as training does (`workers.envs.terminal.grader`):

- `reference_fails`: the reference solution (`solution.sh`) does not pass the hidden tests;
- `untouched_passes`: the untouched workspace already passes them (a no-op policy is paid);
- `nondeterministic`: `repeats` gradings of the reference disagree (reward or per-test outcome);
- `grading_error`: grading itself failed (the sandbox, not the task's tests) on some run.

`no_reference` is a flag (full reward unchecked), not a quarantine. The report follows the
shape of `crucible.qc/1` (`quarantined`, `quarantined_ids`, `flags`, `tasks`, `summary`) so a
reader of environment QC reads it the same way. A `qc` run on an environment version whose
source is `terminal` comes here through `workers.qc.run.run_qc_spec` (`run_terminal_qc`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from workers.envs.spec import TerminalEnvSpec
from workers.envs.terminal.episode import prepare, run_script
from workers.envs.terminal.grader import GradeResult
from workers.envs.terminal.task import TerminalTask
from workers.qc.spec import QcSpec
from workers.sandbox.sessions import SessionManager

REPORT_SCHEMA = "crucible.qc.terminal/1"


def _outcomes(grade: GradeResult) -> tuple[float, tuple[tuple[str, str], ...]]:
    return grade.reward, tuple((str(r.get("test")), str(r.get("outcome"))) for r in grade.results)


def check_task(manager: SessionManager, task: TerminalTask, repeats: int = 2) -> dict[str, Any]:
    """The QC verdict of one task: status, reasons and what each probe scored."""
    started = time.monotonic()
    reasons: list[dict[str, str]] = []
    entry: dict[str, Any] = {"task_id": task.id, "split": task.split}
    snap = prepare(manager, task)
    try:
        untouched = run_script(manager, task, None, snap)
        entry["untouched_reward"] = untouched.reward
        if untouched.error and untouched.infra:
            reasons.append({"check": "grading_error", "detail": untouched.error})
        elif untouched.reward > 0:
            reasons.append({"check": "untouched_passes",
                            "detail": f"the untouched workspace passes {untouched.passed}/"
                                      f"{untouched.total} hidden tests"})
        if task.reference is None:
            entry["flags"] = ["no_reference"]
        else:
            runs = [run_script(manager, task, task.reference, snap) for _ in range(repeats)]
            entry["reference_rewards"] = [g.reward for g in runs]
            failed = [g for g in runs if g.error and g.infra]
            if failed:
                reasons.append({"check": "grading_error", "detail": str(failed[0].error)})
            elif runs[0].reward < 1.0:
                bad = [f"{r.get('test')}: {r.get('outcome')}" for r in runs[0].results
                       if r.get("outcome") != "passed"]
                reasons.append({"check": "reference_fails",
                                "detail": runs[0].error or "; ".join(bad)[:500]})
            if len({_outcomes(g) for g in runs}) > 1:
                reasons.append({"check": "nondeterministic",
                                "detail": "gradings of the reference disagree: "
                                          f"{[g.reward for g in runs]}"})
            entry["deterministic"] = len({_outcomes(g) for g in runs}) == 1
    finally:
        manager.drop_snapshot(snap)
    entry["status"] = "quarantined" if reasons else "ok"
    entry["reasons"] = reasons
    entry["seconds"] = round(time.monotonic() - started, 3)
    return entry


def qc_terminal_tasks(manager: SessionManager, tasks: Sequence[TerminalTask], repeats: int = 2,
                      quarantine_threshold: float = 0.1) -> dict[str, Any]:
    """QC every task; the set is blocked when the quarantined share exceeds the threshold."""
    started = datetime.now(UTC)
    entries = [check_task(manager, t, repeats) for t in tasks]
    quarantined = [e for e in entries if e["status"] == "quarantined"]
    rate = len(quarantined) / len(entries) if entries else 1.0
    by_reason: dict[str, int] = {}
    for e in quarantined:
        for r in e["reasons"]:
            by_reason[r["check"]] = by_reason.get(r["check"], 0) + 1
    block = []
    if not entries:
        block.append("no tasks")
    elif rate > quarantine_threshold:
        block.append(f"{len(quarantined)} of {len(entries)} tasks quarantined "
                     f"({rate:.0%} > {quarantine_threshold:.0%})")
    return {
        "schema": REPORT_SCHEMA, "config": {"repeats": repeats,
                                            "quarantine_threshold": quarantine_threshold},
        "passed": not block, "blocked": bool(block), "block_reasons": block,
        "summary": {"tasks": len(entries), "quarantined": len(quarantined),
                    "quarantine_rate": rate, "by_reason": by_reason},
        "quarantined": [{"task_id": e["task_id"], "reasons": e["reasons"]} for e in quarantined],
        "quarantined_ids": [e["task_id"] for e in quarantined],
        "flags": [{"kind": "no_reference", "task_ids": [e["task_id"]]}
                  for e in entries if "no_reference" in e.get("flags", [])],
        "tasks": entries,
        "started_at": started.isoformat(), "finished_at": datetime.now(UTC).isoformat(),
    }


def run_terminal_qc(env: TerminalEnvSpec, qc: QcSpec, resolve_dataset: Any = None
                    ) -> dict[str, Any]:
    """QC of a terminal environment version with the run's `repeats` and
    `quarantine_threshold` (the other QcSpec knobs are for answer-checked tasks). Tasks that
    do not load, or a host that cannot open sessions, give a blocked report saying why."""
    from workers.envs.load import terminal_tasks

    started = time.perf_counter()
    try:
        tasks = terminal_tasks(env, resolve_dataset)
        with SessionManager() as manager:
            report = qc_terminal_tasks(manager, tasks, repeats=qc.repeats,
                                       quarantine_threshold=qc.quarantine_threshold)
    except Exception as exc:  # noqa: BLE001 - every failure is the report's finding
        now = datetime.now(UTC).isoformat()
        detail = f"{type(exc).__name__}: {exc}"
        report = {
            "schema": REPORT_SCHEMA, "config": {"repeats": qc.repeats,
                                                "quarantine_threshold": qc.quarantine_threshold},
            "passed": False, "blocked": True,
            "block_reasons": [f"environment check 'load' failed: {detail}"],
            "summary": {"tasks": 0, "quarantined": 0, "quarantine_rate": 0.0, "by_reason": {}},
            "quarantined": [], "quarantined_ids": [], "flags": [], "tasks": [],
            "started_at": now, "finished_at": now,
        }
    report["timings"] = {"total_s": round(time.perf_counter() - started, 3)}
    return report
