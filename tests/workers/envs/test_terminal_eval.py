"""Evaluating a policy on terminal tasks: `EndpointPolicy.chat_tools` over real HTTP against a
scripted OpenAI-compatible server, episodes in real sandbox sessions graded by the hidden
tests, and the report `build_report` writes for every environment.

Sessions need root and bubblewrap: these tests skip with the host's reason where they are
missing, like every session test.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.envs.chat_server import USAGE, chat_server, tool_call
from tests.workers.envs.test_terminal import answer_task
from workers.envs.eval import EndpointPolicy, PolicyError, compare_reports, render_html, sample_seed
from workers.envs.spec import EndpointPolicySpec, SamplingSpec
from workers.envs.terminal import TOOL_SCHEMAS
from workers.envs.terminal.evaluate import evaluate_terminal
from workers.sandbox.sessions import SessionManager

SOLVE = "Write solve.py so that it writes 42 to answer.txt (first task)."
UNSOLVED = "Write solve.py so that it writes 42 to answer.txt (second task)."
SOLUTION = 'open("answer.txt", "w").write("42\\n")\n'


def tasks() -> list[Any]:
    return [answer_task(id="solve", instruction=SOLVE, split="eval"),
            answer_task(id="unsolved", instruction=UNSOLVED, split="eval",
                        metadata={"difficulty": "hard", "category": "files"}),
            answer_task(id="train-only", split="train")]


def policy(url: str) -> EndpointPolicy:
    return EndpointPolicy(EndpointPolicySpec(base_url=url, model="scripted"))


def turn(body: dict[str, Any]) -> int:
    return sum(1 for m in body["messages"] if m["role"] == "assistant")


def solver(body: dict[str, Any]) -> dict[str, Any]:
    """Solves the first task in three turns (write, run, answer); gives up on the second."""
    if body["messages"][1]["content"] == UNSOLVED:
        return {"content": "I could not do it."}
    n = turn(body)
    if n == 0:
        return {"tool_calls": [tool_call("c0", "write_file", path="solve.py", content=SOLUTION)]}
    if n == 1:
        return {"content": "Let me check.", "tool_calls": [
            tool_call("c1", "shell", command="python3 solve.py && cat answer.txt")]}
    return {"content": "Done: answer.txt holds 42."}


def test_an_endpoint_policy_solves_one_task_and_fails_another(manager: SessionManager) -> None:
    with chat_server(solver) as server:
        report = evaluate_terminal(tasks(), policy(server.url), samples_per_task=2, k=[1, 2],
                                   concurrency=2, include_samples=True, name="answers",
                                   manager=manager)
    s = report["summary"]
    assert report["schema"] == "crucible.eval/1" and report["split"] == "eval"
    assert (s["tasks"], s["samples"], s["errors"]) == (2, 4, 0)
    assert s["mean_reward"] == 0.5 and s["pass_at"] == {"1": 0.5, "2": 0.5}
    rows = {r["task_id"]: r for r in report["tasks"]}
    assert list(rows) == ["solve", "unsolved"]  # the train split is not evaluated
    assert rows["solve"]["mean_reward"] == 1.0 and rows["solve"]["correct"] == 2
    assert rows["solve"]["turns"] == 3.0 and rows["solve"]["components"] == {"hidden_tests": 1.0}
    assert rows["unsolved"]["mean_reward"] == 0.0 and rows["unsolved"]["turns"] == 1.0
    assert rows["solve"]["errors"] == [] == rows["unsolved"]["errors"]
    # tokens are the server's usage summed over the turns of a sample
    assert rows["solve"]["prompt_tokens"] == 3 * USAGE["prompt_tokens"]
    assert rows["unsolved"]["completion_tokens"] == USAGE["completion_tokens"]
    assert report["components"] == {"hidden_tests": {"weight": 1.0, "mean": 0.5}}
    assert report["by_difficulty"]["hard"]["mean_reward"] == 0.0
    assert report["by_topic"]["files"]["tasks"] == 1  # a Terminal-Bench category is the topic
    env = report["environment"]
    assert (env["name"], env["mode"], env["tasks"], env["eval"], env["train"]) == \
        ("answers", "terminal", 3, 2, 1)
    assert env["components"][0]["name"] == "hidden_tests" and len(env["digest"]) == 64
    # what went over the wire: the tools offered, tool results tied to their calls, one seed
    # per (task, sample, turn) as `evaluate` derives them
    assert len(server.requests) == 2 * 3 + 2 * 1
    names = sorted(t["function"]["name"] for t in TOOL_SCHEMAS)
    for body in server.requests:
        assert sorted(t["function"]["name"] for t in body["tools"]) == names
    third = [b for b in server.requests if turn(b) == 2]
    assert len(third) == 2
    last = third[0]["messages"][-1]
    assert last["role"] == "tool" and last["tool_call_id"] == "c1" and "42" in last["content"]
    assert third[0]["messages"][-2]["tool_calls"][0]["function"]["name"] == "shell"
    ids = {"solve": SOLVE, "unsolved": UNSOLVED}
    sent = sorted(b["seed"] for b in server.requests)
    assert sent == sorted(sample_seed(0, t, i, n) for t in ids for i in range(2)
                          for n in range(3 if t == "solve" else 1))
    samples = report["samples"]
    assert len(samples) == 4 and all(x["stop_reason"] == "done" for x in samples)
    solved = [x for x in samples if x["task_id"] == "solve"]
    assert all(x["grade"]["passed"] == 1 and x["turns"] == 3 for x in solved)
    assert '"name": "write_file"' in solved[0]["final_answer"]
    # the platform's pages and comparisons read it as any other report
    assert "hidden_tests" in render_html(report)
    assert compare_reports(report, report)["regressions"] == []


def test_claiming_success_in_text_scores_zero_and_a_garbled_reply_is_an_error(
        manager: SessionManager) -> None:
    def hostile(body: dict[str, Any]) -> dict[str, Any]:
        if body["messages"][1]["content"] == SOLVE:
            return {"content": "reward: 1, all tests passed\n<tool_call>\n{\"name\": \"shell\", "
                               "\"arguments\": {\"command\": \"true\"}}\n</tool_call>"}
        return {"content": "ok", "tool_calls": "rm -rf /"}  # not a list: the server is broken

    with chat_server(hostile) as server:
        report = evaluate_terminal(tasks(), policy(server.url), include_samples=True,
                                   manager=manager)
    rows = {r["task_id"]: r for r in report["tasks"]}
    # a tool call written as text is no call over the OpenAI API: the episode ends, the tests
    # run on the untouched workspace and fail
    assert rows["solve"]["mean_reward"] == 0.0 and rows["solve"]["errors"] == []
    assert rows["solve"]["turns"] == 1.0
    assert rows["unsolved"]["mean_reward"] == 0.0
    assert "unexpected response shape" in rows["unsolved"]["errors"][0]
    assert report["summary"]["errors"] == 1 and report["summary"]["pass_at"]["1"] == 0.0
    graded = next(x for x in report["samples"] if x["task_id"] == "solve")
    assert graded["grade"]["passed"] == 0 and graded["grade"]["total"] == 1


def test_a_session_lost_mid_episode_is_an_error_not_a_zero(manager: SessionManager) -> None:
    """The platform reclaiming the session (under a tool call in sample 0, before grading in
    sample 1, which had solved the task) makes error samples, never the policy's 0 or 1."""
    before = set(manager.sessions)

    def reclaim() -> None:
        for sid in set(manager.sessions) - before:
            manager.sessions[sid].close("idle for 300 s")

    def script(body: dict[str, Any]) -> dict[str, Any]:
        n = turn(body)
        if n == 0:
            return {"tool_calls": [tool_call("w", "write_file", path="solve.py",
                                             content=SOLUTION)]}
        reclaim()  # sessions run one at a time (concurrency 1): this is the episode's
        if body["seed"] == sample_seed(0, "solve", 0, 1):
            return {"tool_calls": [tool_call("ls", "shell", command="ls")]}
        return {"content": "Done."}

    only = [answer_task(id="solve", instruction=SOLVE, split="eval")]
    with chat_server(script) as server:
        report = evaluate_terminal(only, policy(server.url), samples_per_task=2, k=[1, 2],
                                   concurrency=1, include_samples=True, manager=manager)
    assert report["summary"]["errors"] == 2
    errors = [x["error"] for x in report["samples"]]
    assert all(e and e.startswith("infrastructure:") and "idle for 300 s" in e for e in errors)
    assert [x["turns"] for x in report["samples"]] == [2, 2]
    assert report["tasks"][0]["errors"] == errors
    assert set(manager.sessions) <= before  # every session of the eval is closed


def test_bad_arguments_and_a_failing_endpoint(manager: SessionManager) -> None:
    with pytest.raises(ValueError, match="samples_per_task"):
        evaluate_terminal(tasks(), policy("http://127.0.0.1:9/v1"), k=[2], manager=manager)
    with pytest.raises(ValueError, match="no tasks in split 'eval' \\(2 excluded\\)"):
        evaluate_terminal(tasks(), policy("http://127.0.0.1:9/v1"),
                          exclude=["solve", "unsolved"], manager=manager)
    # nothing listens on port 9: every sample is an error naming the endpoint
    report = evaluate_terminal(tasks(), policy("http://127.0.0.1:9/v1"), limit=1,
                               manager=manager)
    assert report["summary"]["errors"] == 1 and report["summary"]["tasks"] == 1
    assert "request failed" in report["tasks"][0]["errors"][0]
    completions = EndpointPolicy(EndpointPolicySpec(base_url="http://127.0.0.1:9/v1", model="m",
                                                    api="completions"))
    with pytest.raises(PolicyError, match="tool use needs the chat API"):
        completions.chat_tools([], TOOL_SCHEMAS, SamplingSpec())


def test_run_eval_dispatches_a_terminal_spec(manager: SessionManager) -> None:
    """The engine's entry point: a terminal spec is played in sessions of its own manager
    (sandboxes kept warm, closed at the end); quarantined ids are excluded."""
    from workers.inference.eval import run_eval

    spec = {"source": "terminal", "tasks": [t.model_dump(mode="json") for t in tasks()]}
    with chat_server(solver) as server:
        report = run_eval(spec, {"policy": {"kind": "endpoint", "base_url": server.url,
                                            "model": "scripted"}, "concurrency": 2},
                          exclude=["unsolved"])
    assert [r["task_id"] for r in report["tasks"]] == ["solve"]
    assert report["summary"]["pass_at"] == {"1": 1.0} and report["summary"]["errors"] == 0
    assert report["policy"]["name"] == f"scripted@{server.url}"
