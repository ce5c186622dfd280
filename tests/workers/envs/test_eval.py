"""Evaluation: pass@k, reports, HTML, comparisons (policies are plain callables here; the
OpenAI-compatible path is tested against the inference server in test_verifiers.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from workers.envs import load_environment
from workers.envs.base import Message
from workers.envs.checkers import Sandbox
from workers.envs.eval import (
    CallablePolicy,
    compare_reports,
    evaluate,
    pass_at_k,
    render_comparison_html,
    render_html,
)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (10, 0, 1, 0.0),
    (10, 10, 5, 1.0),
    (10, 3, 1, 0.3),                  # c / n
    (5, 2, 2, 1 - 3 / 10),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),         # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    (4, 1, 4, 1.0),                   # n - c < k
    (200, 13, 10, 1 - math.comb(187, 10) / math.comb(200, 10)),
])
def test_pass_at_k_matches_hand_computed_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts() -> None:
    for args in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*args)


def _math_env():
    return load_environment({"source": "builtin", "name": "math",
                             "params": {"count": 30, "eval_fraction": 0.5}})


def test_report_aggregates_reward_pass_at_k_and_breakdowns() -> None:
    env = _math_env()
    answers = {t.prompt: t.answer for t in env.tasks}
    calls: dict[str, int] = {}

    def policy(messages: Sequence[Message]) -> str:
        """Right on every other call per prompt, always right on 'percent' problems."""
        prompt = messages[-1]["content"]
        calls[prompt] = calls.get(prompt, 0) + 1
        topic = next(t.topic for t in env.tasks if t.prompt == prompt)
        ok = topic == "percent" or calls[prompt] % 2 == 1
        return f"\\boxed{{{answers[prompt] if ok else 'nope'}}}"

    report = evaluate(env, CallablePolicy(policy), samples_per_task=4, k=[1, 2, 4],
                      concurrency=1)
    s = report["summary"]
    assert s["tasks"] == 15 and s["samples"] == 60 and s["errors"] == 0
    percent = report["by_topic"]["percent"]
    assert percent["mean_reward"] == 1.0 and percent["pass_at"]["1"] == 1.0
    other = [t for t in report["tasks"] if t["topic"] != "percent"]
    assert all(t["correct"] == 2 and t["pass_at"]["1"] == 0.5 for t in other)
    assert all(t["pass_at"]["2"] == pytest.approx(1 - 1 / 6) for t in other)  # 1 - C(2,2)/C(4,2)
    assert all(t["pass_at"]["4"] == 1.0 for t in report["tasks"])
    n_pct = percent["tasks"]
    assert s["mean_reward"] == pytest.approx((n_pct + 0.5 * (15 - n_pct)) / 15)
    assert report["components"]["boxed"]["mean"] == 1.0
    assert set(report["by_difficulty"]) <= {"easy", "medium", "hard"}
    assert s["latency_s"]["mean"] is not None and report["tasks"][0]["turns"] == 1
    assert report["environment"]["digest"] == env.content_hash()


def test_html_fragment_escapes_everything() -> None:
    env = load_environment({"source": "tasks", "rubric": {"components": [
        {"name": "correct", "checker": "exact_match"}]}, "tasks": [
        {"id": "<script>alert(1)</script>", "prompt": "p", "answer": "a", "split": "eval",
         "topic": "<b>bold</b>"}]})
    report = evaluate(env, CallablePolicy(lambda m: "a", name="<img src=x onerror=1>"))
    fragment = render_html(report)
    assert "<script>" not in fragment and "<b>bold" not in fragment and "<img" not in fragment
    assert "&lt;b&gt;bold&lt;/b&gt;" in fragment and fragment.startswith("<section")


def test_comparison_highlights_regressions() -> None:
    env = _math_env()
    right = {t.prompt: t.answer for t in env.tasks}
    good = evaluate(env, CallablePolicy(lambda m: f"\\boxed{{{right[m[-1]['content']]}}}"))
    worse_topic = "linear"

    def worse(m: Sequence[Message]) -> str:
        task = next(t for t in env.tasks if t.prompt == m[-1]["content"])
        return "\\boxed{0.123}" if task.topic == worse_topic else f"\\boxed{{{task.answer}}}"

    bad = evaluate(env, CallablePolicy(worse))
    cmp = compare_reports(good, bad)
    assert cmp["same_environment"] is True
    assert "mean_reward" in cmp["regressions"] and f"topic={worse_topic} pass@1" in \
        cmp["regressions"]
    assert not any(r.startswith("topic=percent") for r in cmp["regressions"])
    regressed = {t["task_id"] for t in cmp["tasks_regressed"]}
    assert regressed == {t.id for t in env.split("eval") if t.topic == worse_topic}
    assert compare_reports(bad, good)["regressions"] == []
    fragment = render_comparison_html(cmp)
    assert fragment.count('class="regression"') == len(cmp["regressions"])


def test_multi_turn_evaluation_replays_test_failures(sandbox: Sandbox) -> None:
    env = load_environment({"source": "builtin", "name": "code_repair",
                            "params": {"eval_fraction": 0.1}}, sandbox=sandbox)
    tasks = env.split("eval")
    seen_feedback: list[str] = []

    def stubborn_then_fixed(messages: Sequence[Message]) -> str:
        """Returns the buggy code first; after test feedback, the reference."""
        task = next(t for t in tasks if t.prompt == messages[0]["content"])
        if messages[-1]["role"] == "user" and "failed the tests" in messages[-1]["content"]:
            seen_feedback.append(messages[-1]["content"])
            return task.reference or ""
        return "```python\n" + task.metadata["buggy"] + "```"

    report = evaluate(env, CallablePolicy(stubborn_then_fixed), concurrency=2)
    assert report["summary"]["mean_reward"] == 1.0
    assert all(t["turns"] == 2 for t in report["tasks"])
    assert len(seen_feedback) == len(tasks)


def test_excluded_tasks_are_not_evaluated() -> None:
    env = load_environment({"source": "builtin", "name": "arithmetic"})
    skip = [t.id for t in env.split("eval")[:3]]
    report = evaluate(env, CallablePolicy(lambda m: "0"), exclude=skip)
    assert report["summary"]["tasks"] == len(env.split("eval")) - 3
    assert not {t["task_id"] for t in report["tasks"]} & set(skip)


def test_a_sandbox_failure_in_evaluation_is_an_error_not_an_answer(sandbox: Sandbox) -> None:
    """The feedback turn's test run meets a sandbox without Python: the sample is reported as
    an infrastructure error instead of the run crashing or the policy being scored on it."""
    import dataclasses

    from workers.sandbox import languages

    env = load_environment({"source": "builtin", "name": "code_repair",
                            "params": {"eval_fraction": 0.1}}, sandbox=sandbox)
    tasks = env.split("eval")[:1]

    def buggy(messages: Sequence[Message]) -> str:
        return "```python\n" + tasks[0].metadata["buggy"] + "```"

    saved = languages.LANGUAGE_TABLE["python"]
    languages.LANGUAGE_TABLE["python"] = dataclasses.replace(
        saved, requires=("/nonexistent/crucible-python3",))
    try:
        report = evaluate(env, CallablePolicy(buggy), limit=1, include_samples=True)
    finally:
        languages.LANGUAGE_TABLE["python"] = saved
    [sample] = report["samples"]
    assert sample["error"].startswith("infrastructure: the sandbox failed")
    assert report["summary"]["errors"] == 1
