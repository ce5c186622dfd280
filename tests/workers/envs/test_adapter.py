"""Environments served as the RL engine's Objective."""

from __future__ import annotations

from workers.envs import as_objective, load_environment
from workers.envs.builtins.arithmetic import ArithmeticObjective, exact_match
from workers.envs.checkers import Sandbox
from workers.envs.spec import ArithmeticSpec
from workers.qc import forgeries
from workers.sandbox.spec import VERDICTS


def test_arithmetic_environment_is_a_drop_in_for_the_demo_objective() -> None:
    objective = as_objective(load_environment({"source": "builtin", "name": "arithmetic"}))
    demo = ArithmeticObjective(ArithmeticSpec())
    assert [(e.prompt, e.reference) for e in objective.train] == \
        [(e.prompt, e.reference) for e in demo.train]
    assert objective.corpus() == demo.corpus()
    completions = [e.reference for e in objective.eval[:5]] + ["7", "x", "", "1\n2", "-3"]
    examples = objective.eval[:10]
    totals, parts = objective.reward(examples, completions)
    want_totals, want_parts = exact_match(examples, completions)
    assert totals == want_totals and parts == want_parts


def test_math_environment_rewards_with_components_and_metadata() -> None:
    env = load_environment({"source": "builtin", "name": "math", "params": {"count": 20}})
    objective = as_objective(env)
    assert len(objective.train) == 16 and len(objective.eval) == 4
    example = objective.train[0]
    assert example.meta["task_id"] == env.split("train")[0].id
    assert example.meta["topic"] and example.meta["difficulty"]
    totals, parts = objective.reward([example, example], [example.reference, "\\boxed{nope}"])
    assert totals == [1.0, 0.0]
    assert parts == {"correct": [1.0, 0.0], "boxed": [1.0, 1.0]}


def test_quarantined_tasks_never_reach_training() -> None:
    env = load_environment({"source": "builtin", "name": "math", "params": {"count": 20}})
    bad = [env.split("train")[0].id, env.split("eval")[0].id]
    objective = as_objective(env, quarantined=bad)
    assert len(objective.train) == 15 and len(objective.eval) == 3
    assert not {e.meta["task_id"] for e in objective.train + objective.eval} & set(bad)


def test_code_rewards_say_how_each_verdict_was_reached(sandbox: Sandbox) -> None:
    """verdict_<kind> columns (the run's reward/verdict_* metrics): one 1.0 per rollout, so a
    reward that climbs for a reason other than passing tests shows up."""
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=sandbox)
    objective = as_objective(env)
    example = objective.train[0]
    name = forgeries.function_under_test(env.task(example.meta["task_id"]).tests or "")
    completions = [example.reference,  # passes
                   f"```python\ndef {name}(*a, **k):\n    return None\n```",  # fails
                   f"```python\nimport os\ndef {name}(*a):\n    pass\nos._exit(0)\n```"]
    totals, parts = objective.reward([example] * 3, completions)
    assert totals == [1.0, 0.0, 0.0]
    assert set(parts) == {"tests", *(f"verdict_{v}" for v in VERDICTS)}
    assert parts["verdict_passed"] == [1.0, 0.0, 0.0]
    assert parts["verdict_failed"] == [0.0, 1.0, 0.0]
    assert parts["verdict_exited_early"] == [0.0, 0.0, 1.0]
    assert [sum(parts[f"verdict_{v}"][i] for v in VERDICTS) for i in range(3)] == [1.0] * 3
    # a rubric without code checkers has no verdict columns
    math = as_objective(load_environment({"source": "builtin", "name": "math",
                                        "params": {"count": 4}}))
    assert not any(k.startswith("verdict_") for k in math.reward(math.train[:1],
                                                                 ["x"])[1])
