"""`python -m workers.rl train` trains on any environment spec the platform accepts (a built-in,
an uploaded tasks file, a `verifiers` module), and the frozen config names only what applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.envs import load_environment
from workers.rl.__main__ import main
from workers.rl.objectives.environment import objective_from_spec
from workers.rl.sinks import read_jsonl
from workers.rl.spec import SpecError, load_spec, parse_spec

TINY = """
name = "cli-env"
[model.preset]
num_layers = 1
num_experts = 4
hidden_size = 32
moe_intermediate_size = 32
[sft]
steps = 2
batch_size = 4
[rollout]
group_size = 2
max_new_tokens = 4
[trainer]
steps = 2
prompts_per_step = 2
micro_batch_size = 4
eval_samples = 1
[checkpoint]
dir = "{dir}"
[output]
stdout = false
metrics_jsonl = "{dir}/metrics.jsonl"
"""

REVERSAL = [{"id": f"r{i}", "prompt": f"reverse {w}:", "answer": w[::-1],
             "split": "eval" if i % 4 == 0 else "train"}
            for i, w in enumerate(["abc", "dog", "moon", "star", "tree", "lamp", "rope", "wind"])]


def _train(tmp_path: Path, environment: str, capsys: pytest.CaptureFixture[str]) -> dict:
    """Write a config with this [environment] section, train it through the CLI, and return
    the frozen config and the per-step metrics."""
    folder = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(dir=folder) + environment)
    assert main(["train", "--config", str(config)]) == 0, capsys.readouterr().err
    assert "done: 2 steps" in capsys.readouterr().out
    frozen = json.loads((folder / "spec.json").read_text())
    steps = [r["metrics"] for r in read_jsonl(folder / "metrics.jsonl")
             if r["kind"] == "metrics" and "reward_mean" in r["metrics"]]
    assert len(steps) == 2 and (folder / "final" / "config.json").is_file()
    return {"frozen": frozen, "steps": steps}


def _components(steps: list[dict]) -> set[str]:
    return {k.removeprefix("reward/") for k in steps[-1] if k.startswith("reward/")}


def test_trains_on_a_builtin_environment(tmp_path, capsys):
    out = _train(tmp_path, '[environment]\nsource = "builtin"\nname = "math"\n'
                           '[environment.params]\ncount = 24\n', capsys)
    assert out["frozen"]["environment"] == {"source": "builtin", "name": "math",
                                            "params": {"count": 24}}
    assert "task" not in out["frozen"]  # no phantom arithmetic task
    rubric = load_environment(out["frozen"]["environment"]).rubric
    assert _components(out["steps"]) == {c.name for c in rubric.components}
    assert _components(out["steps"]) != {"exact_match", "is_number"}  # not the arithmetic task


def test_trains_on_an_uploaded_tasks_file(tmp_path, capsys):
    (tmp_path / "reversal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REVERSAL))
    env = ('[environment]\nsource = "tasks"\ntasks_file = "reversal.jsonl"\n'
           '[[environment.rubric.components]]\nname = "reversed"\nchecker = "exact_match"\n')
    out = _train(tmp_path, env, capsys)
    frozen_env = out["frozen"]["environment"]
    # The file's records are frozen into the config, so the run says what it trained on.
    assert [t["id"] for t in frozen_env["tasks"]] == [r["id"] for r in REVERSAL]
    assert "tasks_file" not in frozen_env and "task" not in out["frozen"]
    assert _components(out["steps"]) == {"reversed"}


def test_trains_on_a_verifiers_module(tmp_path, capsys):
    pytest.importorskip("verifiers.v1", reason="verifiers>=0.4 (the 'envs' extra) is missing")
    out = _train(tmp_path, '[environment]\nsource = "verifiers"\n'
                           'module = "tests.workers.envs.vf_arith"\n', capsys)
    assert out["frozen"]["environment"]["module"] == "tests.workers.envs.vf_arith"
    assert _components(out["steps"]) == {"correct", "short"}  # the taskset's own rewards


def test_a_bad_environment_is_refused_before_training(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(TINY.format(dir=tmp_path / "run")
                      + '[environment]\nsource = "tasks"\ntasks_file = "missing.jsonl"\n'
                        '[[environment.rubric.components]]\nname = "x"\nchecker = "nope"\n')
    assert main(["train", "--config", str(config)]) == 2
    assert "environment.tasks_file: cannot read" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text(json.dumps(REVERSAL[0]) + "\n")
    config.write_text(config.read_text().replace("missing.jsonl", "t.jsonl"))
    assert main(["validate", "--config", str(config)]) == 2
    assert "rubric.components.0.checker: unknown checker 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(SpecError, match="give task .* or environment, not both"):
        parse_spec({"task": {"max_operand": 5},
                    "environment": {"source": "builtin", "name": "arithmetic"}})
    on_platform = parse_spec({"environment": {
        "source": "tasks", "dataset": {"dataset": "d", "version": 1, "digest": "0" * 64},
        "rubric": {"components": [{"name": "x", "checker": "exact_match"}]}}})
    with pytest.raises(ValueError, match="environment.dataset names a platform dataset"):
        objective_from_spec(on_platform)


def test_frozen_configs_carry_no_phantom_fields(tmp_path):
    default = parse_spec({}).model_dump(mode="json")
    # Nothing named that the run does not use; the defaults still apply.
    assert "task" not in default and "environment" not in default
    assert "dir" not in default["checkpoint"] and default["tokenizer"] == {
        "source": "train", "vocab_size": 96}
    assert parse_spec({}).checkpoint.folder == "var/rl/checkpoints"
    from_model = parse_spec({"model": {"source": "path", "path": "/m"},
                             "tokenizer": {"source": "model"}}).model_dump(mode="json")
    assert from_model["tokenizer"] == {"source": "model"}
    with pytest.raises(SpecError, match="tokenizer.vocab_size applies to a trained tokenizer"):
        parse_spec({"model": {"source": "path", "path": "/m"},
                    "tokenizer": {"source": "model", "vocab_size": 64}})
    # An explicit arithmetic task is kept (it is what the run trains on) and round-trips.
    spec = parse_spec({"task": {"max_operand": 5}})
    assert parse_spec(spec.model_dump(mode="json")) == spec
    assert spec.model_dump(mode="json")["task"]["max_operand"] == 5
    toml = tmp_path / "r.toml"
    toml.write_text('[environment]\nsource = "builtin"\nname = "arithmetic"\n')
    assert load_spec(toml).model_dump(mode="json")["environment"]["name"] == "arithmetic"
