"""Tiny in-process runs, one per policy-loss variant: each trains a few steps with finite
losses and reports its own metrics."""

import math

import pytest

from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import train

TINY = {"preset": {"num_layers": 2, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


def tiny_run(tmp_path, algorithm, **sections):
    data = {
        "model": TINY,
        "sft": {"steps": 2, "batch_size": 8},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False},
        "output": {"stdout": False},
        "algorithm": algorithm,
        **sections,
    }
    result = train(parse_spec(data), JsonlSink(tmp_path / "m.jsonl"))
    records = read_jsonl(tmp_path / "m.jsonl")
    steps = [r["metrics"] for r in records if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert result.steps == 2 and len(steps) == 2
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["pg_loss"]) for m in steps)
    return steps, [r["samples"] for r in records if r["kind"] == "samples"]


@pytest.mark.parametrize(("algorithm", "keys"), [
    ({"importance": "cispo"}, ("clip_frac", "ratio_mean")),
    ({"importance": "seq_tis", "seq_log_ratio": "mean"},
     ("seq/ratio_mean", "seq/ratio_max", "seq/clip_frac")),
    ({"importance": "seq_mis", "updates_per_batch": 2}, ("seq/masked_frac", "seq/ratio_min")),
    ({"importance": "gspo", "loss_agg": "seq_mean"}, ("seq/ratio_mean", "seq/clip_frac")),
])
def test_each_importance_variant_trains(tmp_path, algorithm, keys):
    steps, _ = tiny_run(tmp_path, algorithm)
    for key in keys:
        assert all(key in m and math.isfinite(m[key]) for m in steps), key
    # one update per batch: the first update is on policy, every sequence weight is 1
    if algorithm.get("updates_per_batch", 1) == 1 and "seq/ratio_mean" in steps[0]:
        assert abs(steps[0]["seq/ratio_mean"] - 1.0) < 1e-3


def test_dapo_dynamic_sampling_drops_the_groups_that_stay_uniform(tmp_path):
    steps, _ = tiny_run(tmp_path, {"dynamic_sampling": True, "clip_high": 0.28},
                     curriculum={"max_rounds": 2})
    for m in steps:
        # what the producer could not replace (fallback groups, all uniform) is dropped
        assert m["dapo/dropped_groups"] == m["filter/fallback_groups"]
        assert 0 <= m["dapo/dropped_groups"] <= 2
    # the barely warmed-up policy solves nothing: both groups stay uniform and leave the loss
    # (no token is kept, the policy-gradient term is exactly zero)
    assert steps[0]["dapo/dropped_groups"] == 2
    assert steps[0]["kept_frac"] == 0.0 and steps[0]["pg_loss"] == 0.0


def test_dapo_overlong_shaping_penalises_completions_near_the_limit(tmp_path):
    steps, samples = tiny_run(tmp_path, {"overlong_buffer": 2, "overlong_penalty": 0.5})
    for m, rows in zip(steps, samples, strict=True):
        assert -0.5 <= m["dapo/overlong_penalty"] <= 0.0
        assert 0.0 <= m["dapo/overlong_frac"] <= 1.0
        # the penalty shapes the advantages only: reward_mean stays the mean task reward of
        # the step's sequences (all 8 of them are reported as samples)
        assert len(rows) == 8
        assert abs(m["reward_mean"] - sum(r["reward"] for r in rows) / 8) < 1e-6
