"""Built-in environments: splits, rubrics, references, and code in the real sandbox."""

from __future__ import annotations

import pytest

from workers.envs import load_environment
from workers.envs.builtins.arithmetic import ArithmeticObjective
from workers.envs.builtins.problems import PROBLEMS, fenced
from workers.envs.checkers import Sandbox, extract_code
from workers.envs.spec import ArithmeticSpec


def test_arithmetic_wraps_the_demo_task_exactly() -> None:
    env = load_environment({"source": "builtin", "name": "arithmetic",
                            "params": {"ops": ["+", "-"], "eval_size": 30}})
    demo = ArithmeticObjective(ArithmeticSpec(ops=["+", "-"], eval_size=30))
    assert [t.prompt for t in env.split("eval")] == [e.prompt for e in demo.eval]
    assert [t.prompt for t in env.split("train")] == [e.prompt for e in demo.train]
    tasks = env.split("eval")[:3]
    scores = env.score(tasks, [tasks[0].answer + "\nmore", "x", "-" + (tasks[2].answer or "")])
    assert [s.components["exact_match"] for s in scores][:2] == [1.0, 0.0]
    assert scores[1].components["is_number"] == 0.0
    assert scores[0].total == 1.0 and env.rubric.max_total == 1.0
    assert {t.topic for t in env.tasks} == {"addition", "subtraction"}


def test_math_problems_are_distinct_split_deterministically_and_scored_symbolically() -> None:
    spec = {"source": "builtin", "name": "math", "params": {"count": 50, "seed": 7}}
    env = load_environment(spec)
    assert len({t.prompt for t in env.tasks}) == 50
    assert len(env.split("eval")) == 10
    assert [t.id for t in load_environment(spec).split("eval")] == \
        [t.id for t in env.split("eval")]
    assert load_environment(spec).content_hash() == env.content_hash()
    assert {t.topic for t in env.tasks} == {"decimals", "fractions", "linear", "percent",
                                            "powers"}
    frac = next(t for t in env.tasks if t.answer and "/" in t.answer)
    scores = env.score([frac] * 3, [frac.reference or "", f"\\boxed{{{frac.answer}}}",
                                    "\\boxed{12345}"])
    assert [s.total for s in scores] == [1.0, 1.0, 0.0]
    assert "\\frac" in (frac.reference or "")  # the reference is LaTeX, the answer a/b


def test_math_with_tools_is_a_tool_use_environment() -> None:
    env = load_environment({"source": "builtin", "name": "math",
                            "params": {"count": 10, "tools": ["calculator"], "max_turns": 3}})
    assert env.mode == "tool_use" and env.max_turns == 3 and list(env.tools) == ["calculator"]
    assert "<tool_call>" in env.initial_messages(env.tasks[0])[0]["content"]


def test_code_extraction() -> None:
    assert extract_code("here:\n```python\nx = 1\n```\nand\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("plain text") == "plain text"


def test_code_references_pass_and_buggy_attempts_fail_in_the_sandbox(sandbox: Sandbox) -> None:
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=sandbox)
    assert len(env.tasks) == len(PROBLEMS) and len(env.split("eval")) == 5
    tasks = env.tasks
    scores = env.score(tasks + tasks, [t.reference or "" for t in tasks]
                       + [fenced(p.buggy) for p in PROBLEMS])
    assert [s.total for s in scores[: len(tasks)]] == [1.0] * len(tasks)
    assert [s.total for s in scores[len(tasks):]] == [0.0] * len(tasks)
    assert scores[-1].info["status"] in ("RE", "TLE")
    assert env.self_check() == []


def test_code_repair_feeds_the_failing_test_output_back(sandbox: Sandbox) -> None:
    env = load_environment({"source": "builtin", "name": "code_repair",
                            "params": {"max_turns": 3}}, sandbox=sandbox)
    task = env.task("gcd")
    assert "has a bug" in task.prompt and task.metadata["buggy"] in task.prompt
    conversation = [*env.initial_messages(task),
                    {"role": "assistant", "content": fenced(task.metadata["buggy"])}]
    reply = env.respond(task, conversation)
    assert not reply.done and reply.messages[0]["role"] == "user"
    assert "failed the tests" in reply.messages[0]["content"]
    # the grader says which call failed and what the candidate answered, never the test's text
    assert "a test assertion failed" in reply.messages[0]["content"]
    assert "last call: gcd(" in reply.messages[0]["content"]
    conversation += [*reply.messages, {"role": "assistant", "content": task.reference or ""}]
    assert env.respond(task, conversation).done
    [score] = env.score_conversations([task], [conversation])
    assert score.total == 1.0 and score.info["turns"] == 2


@pytest.mark.parametrize("completion,expected", [
    ("    return a + b\n", 1.0),  # a continuation of the prompt
    ("```python\ndef add(a, b):\n    return a + b\n```", 1.0),  # a whole function (chat)
    ("    return a - b\n", 0.0),
    ("", 0.0),
])
def test_humaneval_style_tasks_accept_continuations_and_whole_functions(
    sandbox: Sandbox, completion: str, expected: float,
) -> None:
    problem = {"task_id": "X/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
               "canonical_solution": "    return a + b\n", "entry_point": "add",
               "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
    from workers.envs.builtins.humaneval import HumanEvalEnvironment
    from workers.envs.spec import HumanEvalParams

    env = HumanEvalEnvironment(HumanEvalParams(), sandbox, problems=[problem])
    assert env.score(env.tasks, [completion])[0].total == expected


def test_uploaded_stdio_tasks_give_partial_credit_and_repair_turns(sandbox: Sandbox) -> None:
    spec = {"source": "tasks", "tasks": [{
        "id": "double", "prompt": "Read n, print 2n.", "reference": "print(2 * int(input()))",
        "cases": [{"stdin": "1\n", "expected_stdout": "2\n"},
                  {"stdin": "5\n", "expected_stdout": "10\n"},
                  {"stdin": "-3\n", "expected_stdout": "-6\n"}]}],
        "rubric": {"components": [{"name": "cases", "checker": "stdio_cases"},
                                  {"name": "fenced", "checker": "regex", "weight": 0.1,
                                   "params": {"pattern": "```"}}]},
        "interaction": {"mode": "multi_turn", "max_turns": 2}}
    env = load_environment(spec, sandbox=sandbox)
    task = env.task("double")
    good, partial, broken = env.score([task] * 3, [
        "```python\nprint(2 * int(input()))\n```", "print(abs(2 * int(input())))", "print(("])
    assert good.total == pytest.approx(1.1) and good.components["cases"] == 1.0
    assert partial.components["cases"] == pytest.approx(2 / 3) and partial.total == \
        pytest.approx(2 / 3)
    assert broken.total == 0.0 and "SyntaxError" in broken.info["feedback"]
    conversation = [*env.initial_messages(task), {"role": "assistant", "content": "print(("}]
    reply = env.respond(task, conversation)
    assert not reply.done and "SyntaxError" in reply.messages[0]["content"]


def test_python_tool_runs_in_the_sandbox(sandbox: Sandbox) -> None:
    env = load_environment({"source": "builtin", "name": "math",
                            "params": {"count": 5, "tools": ["python"]}}, sandbox=sandbox)
    out = env.call_tool("python", {"code": "print(sum(range(10)))"})["content"]
    assert out.startswith("status: OK") and "45" in out
    out = env.call_tool("python", {"code": "import socket\nsocket.create_connection("
                                            "('1.1.1.1', 80), timeout=2)"})["content"]
    assert "status: RE" in out  # no network in the sandbox
