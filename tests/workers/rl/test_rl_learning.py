"""Proof of learning on CPU: tiny MoE, BPE trained on the task, SFT warm start, then GRPO.

Setup (fixed seeds, synchronous, deterministic): a 4-layer Qwen3-MoE (8 experts, top-2) from
the preset is warm-started with 250 SFT steps; sampling at temperature 1.5 it then solves ~46%
of the 20 held-out problems (16 samples each). 150 GRPO steps (8 prompts x 8 samples, lr 1.5e-3
cosine, online difficulty filtering: groups whose 8 rewards are all equal are replaced by
sampling more prompts) raise it. Measured on the dev machine (held-out reward every 25 steps):
0.463, 0.500, 0.497, 0.544, 0.694, 0.716, 0.738 (+0.275); training reward, first vs last 5
steps, 0.47 -> 0.78. Asserted: held-out +0.22, training reward +0.15.

Why these settings: a 2-layer model mostly memorises the 80 training problems (held-out greedy
~30%), which caps what RL can add on held-out prompts (+0.12 at best); 4 layers generalise
(held-out greedy ~0.8) and RL sharpens the sampled distribution towards it. lr 3e-3 collapses,
1e-3 climbs slower (+0.11 in 60 steps); temperature 2.0 starts lower but ends lower too.
"""

import pytest

from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import train

STEPS = 150
HELD_OUT_MARGIN = 0.22
TRAIN_MARGIN = 0.15


@pytest.mark.slow
def test_grpo_raises_held_out_reward_after_sft(tmp_path):
    spec = parse_spec({
        "name": "proof-of-learning",
        "model": {"preset": {"num_layers": 4}},
        "sft": {"steps": 250, "lr": 3e-3, "batch_size": 32},
        "rollout": {"group_size": 8, "max_new_tokens": 4, "temperature": 1.5},
        "algorithm": {"advantage": "grpo"},
        "curriculum": {"filter_uniform": True, "max_rounds": 4},
        "trainer": {"steps": STEPS, "prompts_per_step": 8, "micro_batch_size": 64,
                    "lr": 1.5e-3, "schedule": "cosine", "zero_stage": 2, "seed": 0,
                    "eval_samples": 16, "eval_every": 25},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False},
        "output": {"stdout": False},
    })
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"))
    curve = [round(result.eval_reward[s], 3) for s in sorted(result.eval_reward)]
    before, after = result.eval_reward[0], result.eval_reward[STEPS]
    print(f"held-out reward every 25 steps {curve}; {result.steps_per_s:.2f} RL steps/s")
    assert 0.3 <= before <= 0.55  # the warm start learned something, not everything
    assert after >= before + HELD_OUT_MARGIN
    steps = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "reward_mean" in r["metrics"]]
    assert len(steps) == STEPS
    rewards = [m["reward_mean"] for m in steps]
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + TRAIN_MARGIN
    # the filter did work: some groups taught nothing and were replaced
    assert sum(m["filter/uniform_groups"] for m in steps) > 0
