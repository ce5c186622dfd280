"""Environment specs: what the API validates at registration, and content hashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.envs import load_environment
from workers.envs.load import stored_datasets
from workers.envs.spec import EnvSpecError, EvalSpec, canonical_json, parse_environment_spec
from workers.storage import LocalStore

TASKS = [
    {"id": "a", "prompt": "What is 2+2?", "answer": "4", "split": "train", "topic": "add"},
    {"id": "b", "prompt": "What is 1/2 + 0?", "answer": "1/2", "split": "eval"},
]
RUBRIC = {"components": [{"name": "correct", "checker": "math_equiv"},
                         {"name": "boxed", "checker": "regex", "weight": 0.0,
                          "params": {"pattern": "\\\\boxed"}}]}


def test_each_source_validates() -> None:
    assert parse_environment_spec({"source": "builtin", "name": "math",
                                   "params": {"count": 10}}).env.source == "builtin"
    assert parse_environment_spec({"env": {"source": "verifiers", "module": "my_env.tasks"}}
                                  ).env.source == "verifiers"
    spec = parse_environment_spec({"source": "tasks", "tasks": TASKS, "rubric": RUBRIC})
    assert spec.env.source == "tasks"
    ref = {"dataset": "qa", "version": 3, "digest": "a" * 64}
    assert parse_environment_spec({"source": "tasks", "dataset": ref, "rubric": RUBRIC})


@pytest.mark.parametrize(("data", "needle"), [
    ({"source": "builtin", "name": "chess"}, "unknown built-in environment 'chess'"),
    ({"source": "builtin", "name": "math", "params": {"count": 1}}, "count"),
    ({"source": "builtin", "name": "math", "params": {"cuont": 10}}, "cuont"),
    ({"source": "verifiers", "module": "not a module"}, "dotted Python module name"),
    ({"source": "tasks", "rubric": RUBRIC}, "exactly one of 'tasks'"),
    ({"source": "tasks", "tasks": TASKS + TASKS[:1], "rubric": RUBRIC}, "used twice"),
    ({"source": "tasks", "tasks": TASKS, "rubric": {"components": [
        {"name": "x", "checker": "vibes"}]}}, "unknown checker 'vibes'"),
    ({"source": "tasks", "tasks": TASKS, "rubric": RUBRIC,
      "interaction": {"mode": "tool_use", "max_turns": 3}}, "needs at least one tool"),
    ({"source": "tasks", "tasks": TASKS, "rubric": RUBRIC,
      "interaction": {"mode": "multi_turn", "max_turns": 3}},
     "'unit_tests', 'stdio_cases' or 'call_cases'"),
    ({"source": "nowhere"}, "source"),
])
def test_bad_specs_name_the_problem(data: dict, needle: str) -> None:
    with pytest.raises(EnvSpecError) as err:
        parse_environment_spec(data)
    assert needle in str(err.value)


def test_eval_spec_refuses_k_above_samples() -> None:
    policy = {"kind": "endpoint", "base_url": "http://127.0.0.1:8000", "model": "m"}
    with pytest.raises(ValueError, match="k <= samples_per_task"):
        EvalSpec(policy=policy, samples_per_task=2, k=[1, 5])
    assert EvalSpec(policy=policy, samples_per_task=5, k=[1, 5]).k == [1, 5]


def test_canonical_json_is_key_order_independent() -> None:
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": "é"}]}) == \
        canonical_json({"a": [1, {"c": "é", "d": 2}], "b": 1})
    assert canonical_json({"a": "é"}) == '{"a":"é"}'.encode()


def test_content_hash_covers_what_scores_and_nothing_else() -> None:
    base = {"source": "tasks", "tasks": TASKS, "rubric": RUBRIC}
    digest = load_environment(base).content_hash()
    assert load_environment(dict(base)).content_hash() == digest  # stable
    reordered = {"rubric": RUBRIC, "tasks": [dict(reversed(list(t.items()))) for t in TASKS],
                 "source": "tasks"}
    assert load_environment(reordered).content_hash() == digest
    changed_answer = [{**TASKS[0], "answer": "5"}, TASKS[1]]
    assert load_environment({**base, "tasks": changed_answer}).content_hash() != digest
    reweighted = {"components": [{**RUBRIC["components"][0], "weight": 2.0},
                                 RUBRIC["components"][1]]}
    assert load_environment({**base, "rubric": reweighted}).content_hash() != digest
    # The description is not scoring: the same environment either way.
    assert load_environment({"env": base, "description": "x"}).content_hash() == digest


def test_uploaded_tasks_missing_what_the_rubric_reads_are_refused() -> None:
    tasks = [{"id": "a", "prompt": "Write f", "split": "train"}]
    rubric = {"components": [{"name": "tests", "checker": "unit_tests"}]}
    with pytest.raises(ValueError, match="reads each task's 'tests', missing in tasks"):
        load_environment({"source": "tasks", "tasks": tasks, "rubric": rubric})
    with pytest.raises(ValueError, match="no dataset resolver"):
        load_environment({"source": "tasks", "rubric": RUBRIC,
                          "dataset": {"dataset": "d", "version": 1, "digest": "0" * 64}})


def test_dataset_reference_reads_records_through_the_resolver() -> None:
    ref = {"dataset": "qa", "version": 1, "digest": "b" * 64}
    seen = []

    def resolve(dataset: object) -> list[dict]:
        seen.append(dataset)
        return TASKS

    env = load_environment({"source": "tasks", "dataset": ref, "rubric": RUBRIC},
                           resolve_dataset=resolve)
    assert [t.id for t in env.tasks] == ["a", "b"] and seen[0].version == 1
    with pytest.raises(ValueError, match="dataset record 1 is not a task: prompt"):
        load_environment({"source": "tasks", "dataset": ref, "rubric": RUBRIC},
                         resolve_dataset=lambda _: [{"id": "x"}])


def test_a_worker_reads_pinned_datasets_from_the_uris_its_claim_listed(tmp_path: Path) -> None:
    store = LocalStore((tmp_path / "objects").as_uri())
    lines = "".join(json.dumps(t) + "\n" for t in TASKS) + "\n"  # a blank line is skipped
    uri = store.put_bytes("datasets/qa.jsonl", lines.encode())
    ref = {"dataset": "qa", "version": 1, "digest": "b" * 64}
    resolve = stored_datasets({"b" * 64: uri}, store)
    env = load_environment({"source": "tasks", "dataset": ref, "rubric": RUBRIC},
                           resolve_dataset=resolve)
    assert [t.id for t in env.tasks] == ["a", "b"]
    other = {"dataset": "qa", "version": 2, "digest": "c" * 64}
    with pytest.raises(FileNotFoundError, match=r"qa v2 \(cccccccccccc\) is not among"):
        load_environment({"source": "tasks", "dataset": other, "rubric": RUBRIC},
                         resolve_dataset=resolve)
