"""QC under partial credit: a trivial answer (echoing the prompt, "I don't know.") earns some
similarity by construction, so `trivial_rewarded` judges it against the rubric's range
instead of quarantining anything above 0: on a task it may earn at most `trivial_max_share`
of the graded components' weight, and on average at most `trivial_mean_share` of it (else the
version is blocked). Binary components still must give it nothing."""

from __future__ import annotations

import random

from workers.envs import load_environment
from workers.qc import QcSpec, run_qc

LCS = {"components": [{"name": "similar", "checker": "lcs_ratio",
                       "params": {"case_sensitive": True}}]}


def reversal_tasks(n: int, seed: int = 7) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(5, 9)))
             for _ in range(n)]
    return [{"id": f"r{i}", "prompt": f"Reverse the string: {w}\nReversed:", "answer": w[::-1]}
            for i, w in enumerate(words)]


def _reasons(report: dict) -> dict[str, set[str]]:
    return {q["task_id"]: {r["check"] for r in q["reasons"]} for q in report["quarantined"]}


def test_string_reversal_with_an_lcs_reward_passes_qc() -> None:
    tasks = reversal_tasks(40)
    env = load_environment({"source": "tasks", "tasks": tasks, "rubric": LCS})
    # The trivial answers earn something under LCS (shared letters), but little.
    probes = [a for t in env.tasks for a in env.trivial_answers(t)]
    assert any(t.prompt in probes for t in env.tasks)  # the echo is probed
    report = run_qc(env, QcSpec())
    assert report["passed"], report["block_reasons"]
    assert report["quarantined"] == []
    assert report["summary"]["trivial_allowed"] == 0.75
    rewards = [r["trivial_reward"] for r in report["tasks"]]
    assert all(0 <= r <= 0.75 for r in rewards) and sum(r > 0 for r in rewards) >= 30, rewards
    assert 0 < report["summary"]["trivial_mean"] <= 0.5
    # What the old rule (anything above 0 is rewarded) does to the same version: every task
    # where a trivial answer shares a letter with the reversal is out, and the version blocked.
    strict = run_qc(env, QcSpec(trivial_max_share=0.0))
    earning = {row["task_id"] for row in report["tasks"] if row["trivial_reward"] > 0}
    assert set(_reasons(strict)) == earning and strict["blocked"]
    assert all(_reasons(strict)[i] == {"trivial_rewarded"} for i in earning)


def test_an_echo_that_earns_most_of_the_reward_is_still_quarantined() -> None:
    tasks = [*reversal_tasks(9),
             # Palindromes: echoing the prompt (nearly) answers them.
             {"id": "level", "prompt": "level", "answer": "level"},
             {"id": "abcba", "prompt": "abcba>", "answer": "abcba"}]
    report = run_qc(load_environment({"source": "tasks", "tasks": tasks, "rubric": LCS}),
                    QcSpec(quarantine_threshold=0.5))
    reasons = _reasons(report)
    assert reasons == {"level": {"trivial_rewarded"}, "abcba": {"trivial_rewarded"}}
    detail = next(q for q in report["quarantined"] if q["task_id"] == "abcba")["reasons"][0]
    # The echo "abcba>" shares all five letters: 2*5 / (6+5) = 10/11, above the 0.75 a
    # trivial answer may earn on one task.
    assert "earns 0.909091" in detail["detail"] and "at most 0.75" in detail["detail"]


def test_binary_components_beside_partial_credit_still_give_trivial_answers_nothing() -> None:
    tasks = [{"id": "t1", "prompt": "Greet me", "answer": "hello"},
             {"id": "t2", "prompt": "What do you say when unsure?", "answer": "I don't know"}]
    rubric = {"components": [
        {"name": "exact", "checker": "exact_match", "weight": 1.0},
        {"name": "similar", "checker": "lcs_ratio", "weight": 1.0}]}
    report = run_qc(load_environment({"source": "tasks", "tasks": tasks, "rubric": rubric}),
                    QcSpec(quarantine_threshold=0.6))
    # Allowed: 0.75 x the graded weight (1.0). "I don't know." is t2's answer: it earns the
    # exact-match point and full similarity, 2.0 > 0.75; for t1 it shares a letter or two.
    assert report["summary"]["trivial_allowed"] == 0.75
    assert _reasons(report) == {"t2": {"trivial_rewarded"}}


def test_binary_rubrics_keep_the_zero_rule() -> None:
    tasks = [{"id": "t", "prompt": "Reply with the prompt", "answer": "Reply with the prompt"},
             {"id": "u", "prompt": "What is 2+2?", "answer": "4"}]
    env = load_environment({"source": "tasks", "tasks": tasks, "rubric": {"components": [
        {"name": "exact", "checker": "exact_match"}]}})
    report = run_qc(env, QcSpec(quarantine_threshold=0.9))
    assert report["summary"]["trivial_allowed"] == 0.0
    # Binary rubrics are not probed with the echo; "I don't know." earns nothing here.
    assert report["quarantined"] == []
    assert all(t.prompt not in env.trivial_answers(t) for t in env.tasks)


def test_a_version_whose_trivial_answers_earn_much_on_average_is_blocked() -> None:
    # Each prompt shares its first four letters with the answer: echoing it earns
    # 2*4 / (6+6) = 2/3 everywhere. No task is degenerate (2/3 <= 0.75), but a policy that
    # copies its prompt would collect 2/3 of the reward: the version is blocked, saying so.
    letters = "abcdefghijklmnopqrstuvwxyz"
    tasks = [{"id": f"t{i}", "prompt": letters[i:i + 6], "answer": letters[i:i + 4] + "zz"}
             for i in range(12)]
    report = run_qc(load_environment({"source": "tasks", "tasks": tasks, "rubric": LCS}),
                    QcSpec())
    assert report["quarantined"] == []
    assert report["summary"]["trivial_mean"] == round(2 / 3, 6)
    assert report["blocked"] and len(report["block_reasons"]) == 1
    assert "the best trivial answer earns 0.667 on average over the tasks, above 0.5" in \
        report["block_reasons"][0]
    assert run_qc(load_environment({"source": "tasks", "tasks": tasks, "rubric": LCS}),
                  QcSpec(trivial_mean_share=0.7))["passed"]
