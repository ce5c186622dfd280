"""Balanced experts benchmark: the tiny Qwen3-MoE trained by GRPO on the arithmetic task with
each `moe.balance` mode -- the per-micro-batch Switch loss ("aux", transformers' way), the
aux-loss-free selection bias ("aux_free", DeepSeek-V3), no balancing ("none") and, unless
left out, the global-batch loss ("global_aux") -- from the same seed, the same SFT warm start
and the same number of steps.

Per mode it reports the expert imbalance at the end (MaxVio = max load / mean load - 1,
averaged over layers and over the last `--tail` steps, so one noisy batch does not decide it)
and the held-out reward after the last step (the trainer's own evaluation: the same held-out
prompts and samples per prompt for every mode). Balance is only worth having if the reward
holds, so both figures sit side by side.

There is no peer: the figures compare Crucible's modes, in DESIGN.md's line format:
    moe_maxvio_<mode>: crucible=<v>
    heldout_reward_<mode>: crucible=<v>

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_moe` (`make
bench-moe`); a few minutes on 2 slow cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.trainer import train

MODES = ("aux", "aux_free", "none", "global_aux")


def run_mode(folder: Path, mode: str, steps: int, seed: int, tail: int) -> dict[str, Any]:
    """One seeded SFT + GRPO run in `mode`; its end-of-run MaxVio and held-out reward."""
    spec = parse_spec({
        "name": f"bench-moe-{mode}",
        "model": {"preset": {"num_layers": 4}},
        "sft": {"steps": 250, "lr": 3e-3, "batch_size": 32},
        "rollout": {"group_size": 8, "max_new_tokens": 4, "temperature": 1.5},
        "algorithm": {"advantage": "grpo"},
        "moe": {"balance": mode},
        "trainer": {"steps": steps, "prompts_per_step": 8, "micro_batch_size": 32,
                    "lr": 1.5e-3, "schedule": "cosine", "zero_stage": 2, "seed": seed,
                    "eval_samples": 16},
        "checkpoint": {"dir": str(folder / "ckpt"), "save_final": False},
        "output": {"stdout": False},
    })
    t0 = time.perf_counter()
    result = train(spec, JsonlSink(folder / "m.jsonl"))
    wall = time.perf_counter() - t0
    rows = [r["metrics"] for r in read_jsonl(folder / "m.jsonl")
            if r["kind"] == "metrics" and "loss" in r["metrics"]]
    layers = sorted(k for k in rows[-1] if k.startswith("moe/maxvio/layer_"))
    per_step = [statistics.fmean(m[k] for k in layers) for m in rows[-tail:]]
    first = [statistics.fmean(m[k] for k in layers) for m in rows[:tail]]
    return {"mode": mode, "maxvio": statistics.fmean(per_step),
            "maxvio_start": statistics.fmean(first),
            "reward_before": result.eval_reward[0], "reward": result.eval_reward[steps],
            "wall_s": wall, "steps_per_s": result.steps_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="0,1,2", help="each mode runs once per seed")
    ap.add_argument("--tail", type=int, default=10, help="steps MaxVio is averaged over")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load before: {os.getloadavg()}")
    modes = args.modes.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # seed-major: load drifts over the run alike for every mode
            for mode in modes:
                r = run_mode(Path(tmp) / f"{mode}-{seed}", mode, args.steps, seed, args.tail)
                results[mode].append(r)
                print(f"seed {seed} {mode}: maxvio first {args.tail} steps "
                      f"{r['maxvio_start']:.3f} -> last {args.tail} {r['maxvio']:.3f}; "
                      f"held-out reward {r['reward_before']:.3f} -> {r['reward']:.3f}; "
                      f"{r['wall_s']:.0f} s, {r['steps_per_s']:.2f} RL steps/s", flush=True)
    print(f"load after: {os.getloadavg()}")
    print(f"medians over seeds {seeds}, {args.steps} GRPO steps each:")
    for mode in modes:
        v = statistics.median(r["maxvio"] for r in results[mode])
        print(f"moe_maxvio_{mode}: crucible={v:.4f}")
    for mode in modes:
        v = statistics.median(r["reward"] for r in results[mode])
        print(f"heldout_reward_{mode}: crucible={v:.4f}")


if __name__ == "__main__":
    main()
