"""QC: each planted defect is caught with its reason; clean environments pass."""

from __future__ import annotations

import json
from collections.abc import Sequence

from workers.envs import load_environment
from workers.envs.base import Component, Environment, EnvTask, Rubric
from workers.envs.checkers import Sandbox
from workers.qc import QcSpec, run_qc, run_qc_spec
from workers.qc.dedup import exact_groups, near_pairs

MATH = {"components": [{"name": "correct", "checker": "math_equiv"}]}


def _reasons(report: dict) -> dict[str, set[str]]:
    return {q["task_id"]: {r["check"] for r in q["reasons"]} for q in report["quarantined"]}


def test_clean_builtin_passes_with_a_complete_report() -> None:
    report = run_qc_spec({"source": "builtin", "name": "math", "params": {"count": 20}})
    assert report["passed"] and not report["blocked"] and report["quarantined"] == []
    s = report["summary"]
    assert s["tasks"] == 20 and s["reference_full_reward"] == 20 and s["empty_zero"] == 20
    assert s["usable_tasks"] == {"train": 16, "eval": 4}
    assert [c["check"] for c in report["environment_checks"]] == ["load", "dependencies",
                                                                  "has_tasks"]
    assert report["timings"]["probes"] == 20 * (2 + 1 + 3) + sum(
        r["probes"] - 6 for r in report["tasks"])
    assert all(r["deterministic"] for r in report["tasks"])
    json.dumps(report)  # the report is plain JSON


def test_answer_checked_defects_are_quarantined_with_reasons() -> None:
    tasks = [
        {"id": "ok", "prompt": "What is 6*7?", "answer": "42"},
        {"id": "wrong-ref", "prompt": "What is 2+2?", "answer": "4", "reference": "5"},
        {"id": "dup-1", "prompt": "What is 10/4?", "answer": "5/2"},
        {"id": "dup-2", "prompt": "what is  10/4?", "answer": "2", "split": "eval"},
        {"id": "twin-a", "prompt": "How many legs does a spider have?", "answer": "8"},
        {"id": "twin-b", "prompt": "How many legs does a spider have?", "answer": "8",
         "split": "eval"},
    ]
    report = run_qc_spec({"source": "tasks", "tasks": tasks, "rubric": MATH},
                         QcSpec(quarantine_threshold=0.5))
    reasons = _reasons(report)
    assert reasons == {"wrong-ref": {"reference_fails"}, "dup-1": {"ambiguous_duplicate"},
                       "dup-2": {"ambiguous_duplicate"}}
    kinds = {(f["kind"], tuple(f["task_ids"])) for f in report["flags"]}
    assert ("ambiguous", ("dup-1", "dup-2")) in kinds
    assert ("exact_duplicate", ("twin-a", "twin-b")) in kinds
    assert ("split_leak", ("twin-a", "twin-b")) in kinds
    assert report["summary"]["quarantine_rate"] == 0.5 and not report["blocked"]


def test_lax_checkers_and_free_rewards_are_caught() -> None:
    tasks = [{"id": "num", "prompt": "What is 6*7?", "answer": "42"},
             {"id": "word", "prompt": "Capital of France?", "answer": "Paris"}]
    lax = {"components": [{"name": "mentions", "checker": "contains"}]}
    report = run_qc_spec({"source": "tasks", "tasks": tasks, "rubric": lax})
    assert _reasons(report) == {"num": {"lax_checker"}}  # "421" contains "42"
    detail = report["quarantined"][0]["reasons"][0]["detail"]
    assert "earns full reward" in detail
    free = {"components": [{"name": "says_something", "checker": "regex",
                            "params": {"pattern": "."}}]}
    report = run_qc_spec({"source": "tasks", "tasks": tasks, "rubric": free})
    assert all(r == {"trivial_rewarded"} for r in _reasons(report).values())
    assert report["blocked"] and "2 of 2 tasks quarantined (100.0%)" in \
        report["block_reasons"][0]


class Flaky(Environment):
    """The "flaky" task's correct answer scores 1, 0.5, 1, ... on successive calls."""

    def __init__(self) -> None:
        self.calls = 0

        def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
            out = []
            for task, completion in zip(tasks, completions, strict=True):
                if completion != task.answer:
                    out.append((0.0, {}))
                    continue
                if task.id == "flaky":
                    self.calls += 1
                out.append((0.5 if task.id == "flaky" and self.calls % 2 == 0 else 1.0, {}))
            return out

        super().__init__(tasks=[EnvTask(id=i, prompt=f"say {i}", answer=i, reference=i)
                                for i in ("steady", "flaky")],
                         rubric=Rubric((Component("same", 1.0, fn, "test"),)))


def test_nondeterministic_scoring_is_quarantined() -> None:
    report = run_qc(Flaky(), QcSpec(repeats=3))
    # Reference runs score 1, 0.5, 1: the first is full, the runs disagree.
    assert _reasons(report) == {"flaky": {"nondeterministic"}}
    row = next(r for r in report["tasks"] if r["task_id"] == "flaky")
    assert row["deterministic"] is False


def test_code_tasks_over_their_limits_are_quarantined(sandbox: Sandbox) -> None:
    tests = "assert f(2) == 4\n"
    tasks = [
        {"id": "fine", "prompt": "Write f(x) = 2x.", "tests": tests,
         "reference": "def f(x):\n    return 2 * x\n"},
        {"id": "slow", "prompt": "Write f(x) = x + x.", "tests": tests,
         "reference": "def f(x):\n    while True:\n        pass\n"},
        {"id": "noref", "prompt": "Write f(x) = x * 2.", "tests": tests},
    ]
    spec = {"source": "tasks", "tasks": tasks,
            "rubric": {"components": [{"name": "tests", "checker": "unit_tests"}]},
            "limits": {"wall_ms": 1500, "cpu_ms": 500}}
    report = run_qc_spec(spec, QcSpec(repeats=1), sandbox=sandbox)
    reasons = _reasons(report)
    assert reasons == {"slow": {"limits", "reference_fails"}}
    assert "TLE" in next(r["detail"] for q in report["quarantined"] for r in q["reasons"]
                         if r["check"] == "limits")
    assert {"kind": "no_reference", "task_ids": ["noref"],
            "detail": "no reference completion: full reward is unchecked"} in report["flags"]
    assert report["blocked"]  # 1 of 3 is above the default 10%


def test_a_spec_that_does_not_load_blocks_with_the_reason() -> None:
    report = run_qc_spec({"source": "verifiers", "module": "no_such_env_package_xyz"})
    assert report["blocked"] and not report["passed"]
    assert "cannot import environment module 'no_such_env_package_xyz'" in \
        report["block_reasons"][0]
    json.dumps(report)


def test_missing_dependencies_block_before_scoring() -> None:
    env = load_environment({"source": "builtin", "name": "arithmetic"})
    env.self_check = lambda: ["the python toolchain is missing"]  # type: ignore[method-assign]
    report = run_qc(env)
    assert report["blocked"] and report["timings"]["probes"] == 0
    assert report["block_reasons"] == [
        "environment check 'dependencies' failed: the python toolchain is missing"]


def test_near_duplicates_exact_and_lsh_paths_agree() -> None:
    base = ("Write a function that returns the sum of the squares of all even numbers in a list "
            "of integers, ignoring negative values entirely")
    tasks = [EnvTask(id="a", prompt=base), EnvTask(id="b", prompt=base + " please"),
             EnvTask(id="c", prompt="Reverse a string without using slicing or reversed"),
             EnvTask(id="d", prompt=base.replace("even", "odd")),
             EnvTask(id="e", prompt=base.upper())]
    exact = [(a.id, b.id, s) for a, b, s in near_pairs(tasks, 0.85)]
    lsh = [(a.id, b.id, s) for a, b, s in near_pairs(tasks, 0.85, exact_limit=0)]
    # 23 words -> 21 shingles; one extra word adds one: 21/22. "odd" changes 3: 18/24.
    assert exact == lsh == [("a", "b", 0.9545), ("b", "e", 0.9545)]
    assert [[t.id for t in g] for g in exact_groups(tasks)] == [["a", "e"]]


def test_every_builtin_passes_qc(sandbox: Sandbox) -> None:
    for spec in ({"source": "builtin", "name": "arithmetic", "params": {"ops": ["+", "*"]}},
                 {"source": "builtin", "name": "code_repair"}):
        report = run_qc_spec(spec, sandbox=sandbox)
        assert report["passed"] and report["quarantined"] == [], report["quarantined"][:3]
        assert report["summary"]["reference_full_reward"] == report["summary"]["tasks"]
    # code_repair's trivial answers include the buggy starting code: it must earn nothing.
    assert all(r["trivial_reward"] == 0.0 for r in report["tasks"])


def test_a_forgeable_grader_is_quarantined_and_blocks_the_version(sandbox: Sandbox) -> None:
    """Tests that call the function but assert nothing: the reference passes and an empty
    answer fails (NameError), yet every forgery that defines `add` returning None scores."""
    vacuous = "add(2, 3)\nadd(-1, 1)\n"
    strict = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    reference = "def add(a, b):\n    return a + b\n"
    tasks = [{"id": "vacuous", "prompt": "Write add(a, b).", "tests": vacuous,
              "reference": reference},
             {"id": "strict", "prompt": "Write add(a, b) returning a + b.", "tests": strict,
              "reference": reference}]
    spec = {"source": "tasks", "tasks": tasks,
            "rubric": {"components": [{"name": "tests", "checker": "unit_tests"}]}}
    report = run_qc_spec(spec, QcSpec(repeats=1, quarantine_threshold=1.0), sandbox=sandbox)
    reasons = _reasons(report)
    assert "forgeable" in reasons["vacuous"] and "strict" not in reasons
    assert report["blocked"] and any(b.startswith("forgeable:") for b in
                                     report["block_reasons"])
    assert "py_exec_replaced" in report["summary"]["forgeable"]
    assert report["summary"]["forgery_probes"] >= 2 * 15
    # the same tasks with forgery probes off: nothing says the grader can be fooled
    off = run_qc_spec(spec, QcSpec(repeats=1, quarantine_threshold=1.0, forgeries=False),
                      sandbox=sandbox)
    assert "forgeable" not in {r for rs in _reasons(off).values() for r in rs}
