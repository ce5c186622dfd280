"""Proof of learning on CPU: tiny MoE, BPE trained on the task, SFT warm start, then GRPO.

Setup (fixed seeds): a 2-layer Qwen3-MoE (8 experts, top-2) from the preset is warm-started with
250 SFT steps, which leaves it right on ~27% of the held-out problems when sampling at
temperature 1.5 (a 2-layer model memorises more than it generalises: greedy decoding gets ~30%
of held-out problems and ~88% of training ones). 60 GRPO steps (8 prompts x 8 samples, cosine LR)
then raise the held-out reward; measured on the dev machine: 0.27 -> 0.39 (0.41 at step 20),
while the on-policy training reward (first 5 vs last 5 steps) goes from 0.66 to 0.85.
Asserted: held-out +0.08, training reward +0.10.
"""

import pytest

from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import train

HELD_OUT_MARGIN = 0.08
TRAIN_MARGIN = 0.10


@pytest.mark.slow
def test_grpo_raises_held_out_reward_after_sft(tmp_path):
    spec = parse_spec({
        "name": "proof-of-learning",
        "model": {"preset": {"num_layers": 2}},
        "sft": {"steps": 250, "lr": 3e-3, "batch_size": 32},
        "rollout": {"group_size": 8, "max_new_tokens": 4, "temperature": 1.5},
        "algorithm": {"advantage": "grpo"},
        "trainer": {"steps": 60, "prompts_per_step": 8, "micro_batch_size": 64, "lr": 1e-3,
                    "schedule": "cosine", "zero_stage": 2, "seed": 0,
                    "eval_samples": 16},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False},
        "output": {"stdout": False},
    })
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"))
    before, after = result.eval_reward[0], result.eval_reward[60]
    print(f"held-out reward {before:.3f} -> {after:.3f}; {result.steps_per_s:.2f} RL steps/s")
    assert 0.05 <= before <= 0.45  # the warm start learned something, not everything
    assert after >= before + HELD_OUT_MARGIN
    rewards = [r["metrics"]["reward_mean"] for r in read_jsonl(tmp_path / "m.jsonl")
               if r["kind"] == "metrics" and "reward_mean" in r["metrics"]]
    assert len(rewards) == 60
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + TRAIN_MARGIN
