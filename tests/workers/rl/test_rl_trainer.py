"""In-process training runs (a world of one): checkpoints, metrics, ZeRO-3, NaN handling."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.rl import checkpoint as ckpt
from workers.rl.objectives import build_objective
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import TrainingFailed, train

TINY = {"preset": {"num_layers": 2, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


def tiny_spec(tmp_path, **sections):
    data = {
        "model": TINY,
        "sft": {"steps": 3, "batch_size": 8},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": 4, "prompts_per_step": 2, "micro_batch_size": 4},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1, "keep": 2},
        "output": {"stdout": False},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return parse_spec(data)


def test_zero3_run_writes_atomic_checkpoints_and_reports_metrics(tmp_path):
    spec = tiny_spec(tmp_path, trainer={"zero_stage": 3},
                     algorithm={"kl_coef": 0.05, "dpo_coef": 0.1, "entropy_coef": 0.001})
    sink = JsonlSink(tmp_path / "m.jsonl")
    result = train(spec, sink)
    root = tmp_path / "ckpt"
    # keep = 2: only the last two survive, and no temporary directory is left behind
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-000003", "step-000004"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    last = root / "step-000004"
    state = json.loads((last / "state.json").read_text())
    assert state["step"] == 4 and state["cursor"] == 4 * 2 and state["nan_streak"] == 0
    assert (last / "rng-rank0.pt").is_file() and (last / "ds").is_dir()
    assert json.loads((root / "spec.json").read_text())["trainer"]["zero_stage"] == 3
    # HF-format checkpoints load with plain transformers and match the final weights
    a = AutoModelForCausalLM.from_pretrained(last / "hf", local_files_only=True)
    b = AutoModelForCausalLM.from_pretrained(result.final_dir, local_files_only=True)
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    sft = AutoModelForCausalLM.from_pretrained(root / "sft", local_files_only=True)
    assert not torch.equal(sft(input_ids=ids).logits, a(input_ids=ids).logits)

    recs = read_jsonl(tmp_path / "m.jsonl")
    steps = [r for r in recs if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    m = steps[-1]["metrics"]
    for key in ("reward_mean", "reward_std", "reward/exact_match", "reward/is_number", "loss",
                "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "ratio_max",
                "ratio_min", "aux_loss", "lr", "gen_tokens_per_s", "train_tokens_per_s",
                "moe/layer0/load_entropy", "moe/layer1/expert3_tokens"):
        assert key in m, key
    assert 0.0 <= m["moe/layer0/load_entropy"] <= 1.0 and m["kl"] >= 0.0
    # one update per rollout batch: the trained policy is the sampling policy (ratio 1)
    assert abs(steps[0]["metrics"]["ratio_mean"] - 1.0) < 1e-3
    assert [r["step"] for r in recs if r["kind"] == "checkpoint"] == [1, 2, 3, 4, 4]
    assert recs[0]["kind"] == "event" and "zero_stage" in recs[0]["message"]
    with pytest.raises(ValueError, match="already holds a run"):
        train(spec, sink)


class NaNAfter:
    """The arithmetic objective, but its reward turns NaN after `good` calls (a broken reward)."""

    def __init__(self, good: int):
        base = build_objective(parse_spec({}).task)
        self.train, self.eval, self.good, self.calls = base.train, base.eval, good, 0
        self._base = base

    def corpus(self):
        return self._base.corpus()

    def reward(self, examples, completions):
        self.calls += 1
        rewards, parts = self._base.reward(examples, completions)
        if self.calls > self.good:
            rewards = [float("nan")] * len(rewards)
        return rewards, parts


def test_nan_steps_are_skipped_then_the_run_fails_with_checkpoint_intact(tmp_path):
    spec = tiny_spec(tmp_path, trainer={"steps": 8, "max_consecutive_nan": 2},
                     checkpoint={"every": 2})
    sink = JsonlSink(tmp_path / "m.jsonl")
    # call 1 is the held-out evaluation before SFT, call 2 the one at RL step 0, then steps
    # 1 and 2
    objective = NaNAfter(good=4)
    with pytest.raises(TrainingFailed, match="2 consecutive non-finite losses at step 4"):
        train(spec, sink, objective=objective)
    root = tmp_path / "ckpt"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-000002"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    model = AutoModelForCausalLM.from_pretrained(root / "step-000002" / "hf",
                                                 local_files_only=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    recs = read_jsonl(tmp_path / "m.jsonl")
    warnings = [r for r in recs if r["kind"] == "event" and r["level"] == "warning"]
    assert [w["data"]["step"] for w in warnings] == [3, 4]
    errors = [r for r in recs if r["kind"] == "event" and r["level"] == "error"]
    assert len(errors) == 1 and errors[0]["data"]["last_checkpoint"].endswith("step-000002")
    # skipped steps report rewards but no loss
    by_step = {r["step"]: r["metrics"] for r in recs if r["kind"] == "metrics"}
    assert "loss" in by_step[2] and "loss" not in by_step[3]
    # and the run resumes from the last good checkpoint once the reward is fixed
    result = train(spec.model_copy(update={"trainer": spec.trainer.model_copy(
        update={"steps": 3})}), sink, resume=True)
    assert result.steps == 3 and 3 in result.losses


class NaNInSecondGroup(NaNAfter):
    """At one call, only the second prompt's group (the second micro-batch) gets NaN rewards."""

    def __init__(self, call: int):
        super().__init__(good=10**9)
        self.bad_call = call

    def reward(self, examples, completions):
        rewards, parts = super().reward(examples, completions)
        if self.calls == self.bad_call:
            half = len(rewards) // 2
            rewards = rewards[:half] + [float("nan")] * (len(rewards) - half)
        return rewards, parts


def test_nan_in_a_later_micro_batch_drops_only_that_micro_batch(tmp_path):
    spec = tiny_spec(tmp_path, trainer={"steps": 3, "micro_batch_size": 4},
                     checkpoint={"every": 0})
    sink = JsonlSink(tmp_path / "m.jsonl")
    # calls 1 and 2: held-out evaluations before SFT and at RL step 0; call 4 is step 2
    result = train(spec, sink, objective=NaNInSecondGroup(call=4))
    assert result.skipped_steps == [] and sorted(result.losses) == [1, 2, 3]
    assert all(v == v for v in result.losses.values())  # no NaN reported as a loss
    by_step = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
               if r["kind"] == "metrics" and "loss" in r["metrics"]}
    assert by_step[2]["dropped_microbatches"] == 1 and by_step[3]["dropped_microbatches"] == 0
    final = AutoModelForCausalLM.from_pretrained(result.final_dir, local_files_only=True)
    assert all(torch.isfinite(p).all() for p in final.parameters())
