"""Proof of learning on CPU: tiny MoE, BPE trained on the objective, SFT warm start, then GRPO.

Setup (synchronous, deterministic per machine): a 4-layer Qwen3-MoE (8 experts, top-2) from the
preset is warm-started with 250 SFT steps; sampling at temperature 1.5 it then solves roughly
40-55% of the 20 held-out problems (16 samples each). 150 GRPO steps (8 prompts x 8 samples,
lr 1.5e-3 cosine, online difficulty filtering: groups whose 8 rewards are all equal are replaced
by sampling more prompts) raise it.

Why the statistic is the share of the headroom closed, pooled over three seeds: a fixed-seed
CPU run is reproducible on one machine but not across CPUs (kernels round differently), and where
the warm start lands moves with that rounding: seed 0 started at 0.463 on one x86-64 VM, at 0.547
on another (ending at 0.741: +0.19, which failed the old fixed +0.22 margin), at 0.394 with
`ATEN_CPU_CAPABILITY=default`. An absolute gain is capped by what the warm start left to learn;
the share of it that RL closes, (after - before) / (1 - before), is not. One run's share still
moves with its trajectory (0.25 to 0.63 across seeds and kernels; some seeds dip below the warm
start for 50 steps before they climb), so three independently seeded runs (each seed changes the
SFT batches, the RL samples and the evaluation draws) are pooled: the summed gains over the summed
headroom, which averages that noise out (0.44 on AVX2 kernels, 0.40 on the default kernels, on
the 2-core development VM), against a bar of 0.25. Each run must also end above its own warm
start, and the training reward must close 0.3 of its headroom the same way (seen 0.6-0.7).

A model that does not learn fails it: with the RL learning rate at 1e-12 each run's held-out
reward after 150 steps equals its warm start's (the evaluation draws the same samples from the
same weights), so the share closed is 0.

Why these settings: a 2-layer model mostly memorises the 80 training problems (held-out greedy
~30%), which caps what RL can add on held-out prompts; 4 layers generalise (held-out greedy
~0.8) and RL sharpens the sampled distribution towards it. lr 3e-3 collapses, 1e-3 climbs
slower; temperature 2.0 starts lower but ends lower too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import train

STEPS = 150
SEEDS = (0, 1, 2)
# Share of the remaining headroom (1 - reward) that RL closes, pooled over the seeds.
HELD_OUT_CLOSED = 0.25
TRAIN_CLOSED = 0.3  # the same for the training reward, first vs last 5 steps
WARM_START = (0.1, 0.85)  # learned something, and left room to measure learning


def closed_share(before: float | list[float], after: float | list[float]) -> float:
    """The share of the headroom `1 - before` that `after` closed (negative if it fell);
    for lists (one entry per run), the summed gains over the summed headroom."""
    b = before if isinstance(before, list) else [before]
    a = after if isinstance(after, list) else [after]
    room = sum(1.0 - x for x in b)
    return (sum(a) - sum(b)) / room if room > 0 else 0.0


def train_and_read(spec: Any, folder: Path) -> tuple[Any, list[dict[str, Any]],
                                                     tuple[float, float]]:
    """Train `spec` logging to `folder`: the run's result, each RL step's metrics, and the
    mean training reward of the first and of the last 5 steps."""
    result = train(spec, JsonlSink(folder / "m.jsonl"))
    steps = [r["metrics"] for r in read_jsonl(folder / "m.jsonl")
             if r["kind"] == "metrics" and "reward_mean" in r["metrics"]]
    rewards = [m["reward_mean"] for m in steps]
    return result, steps, (sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5)


def learning_run(folder: Path, seed: int, lr: float = 1.5e-3) -> dict[str, Any]:
    """One seeded SFT + GRPO run; its held-out curve and per-step training metrics."""
    spec = parse_spec({
        "name": "proof-of-learning",
        "model": {"preset": {"num_layers": 4}},
        "sft": {"steps": 250, "lr": 3e-3, "batch_size": 32},
        "rollout": {"group_size": 8, "max_new_tokens": 4, "temperature": 1.5},
        "algorithm": {"advantage": "grpo"},
        "curriculum": {"filter_uniform": True, "max_rounds": 4},
        "trainer": {"steps": STEPS, "prompts_per_step": 8, "micro_batch_size": 64,
                    "lr": lr, "schedule": "cosine", "zero_stage": 2, "seed": seed,
                    "eval_samples": 16, "eval_every": 50},
        "checkpoint": {"dir": str(folder / "ckpt"), "save_final": False},
        "output": {"stdout": False},
    })
    result, steps, (first, last) = train_and_read(spec, folder)
    before, after = result.eval_reward[0], result.eval_reward[STEPS]
    return {
        "seed": seed, "before": before, "after": after, "steps": steps,
        "curve": [round(result.eval_reward[s], 3) for s in sorted(result.eval_reward)],
        "held_out_closed": closed_share(before, after),
        "train_closed": closed_share(first, last), "train": (first, last),
        "steps_per_s": result.steps_per_s,
    }


def test_closed_share_is_relative_to_the_headroom():
    assert closed_share(0.5, 0.75) == pytest.approx(0.5)
    assert closed_share(0.4, 0.7) == pytest.approx(0.5)  # same share from a lower start
    assert closed_share(0.6, 0.6) == 0.0 and closed_share(0.6, 0.5) < 0
    assert closed_share(1.0, 1.0) == 0.0
    # pooled: (0.2 + 0.0) / (0.5 + 0.5)
    assert closed_share([0.5, 0.5], [0.7, 0.5]) == pytest.approx(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # three runs: about 2 CPU-minutes, several times that under load
def test_grpo_raises_held_out_reward_after_sft(tmp_path):
    runs = [learning_run(tmp_path / f"seed{seed}", seed) for seed in SEEDS]
    for r in runs:
        print(f"seed {r['seed']}: held-out every 50 steps {r['curve']} "
              f"(closed {r['held_out_closed']:.2f} of the headroom); training reward "
              f"{r['train'][0]:.3f} -> {r['train'][1]:.3f} (closed {r['train_closed']:.2f}); "
              f"{r['steps_per_s']:.2f} RL steps/s")
        assert WARM_START[0] <= r["before"] <= WARM_START[1], r["curve"]
        assert len(r["steps"]) == STEPS
    held_out = closed_share([r["before"] for r in runs], [r["after"] for r in runs])
    trained = closed_share([r["train"][0] for r in runs], [r["train"][1] for r in runs])
    print(f"share of the headroom closed, pooled over seeds {SEEDS}: held-out {held_out:.2f}, "
          f"training {trained:.2f}")
    assert held_out >= HELD_OUT_CLOSED
    assert trained >= TRAIN_CLOSED
    assert all(r["after"] > r["before"] for r in runs), [r["curve"] for r in runs]
    # the filter did work: some groups taught nothing and were replaced
    assert all(sum(m["filter/uniform_groups"] for m in r["steps"]) > 0 for r in runs)
