"""RL engine benchmark: Crucible's GRPO loop next to TRL's GRPOTrainer, and sync vs async.

Both start from the same SFT warm start of the tiny Qwen3-MoE preset (Crucible's SFT phase,
saved in HF format; a random-init policy does not learn) with the same BPE tokenizer, and run
the same GRPO settings: prompts per step, group size, max new tokens, temperature, learning
rate with linear decay to 0, PPO clip 0.2 both sides, no KL (beta 0), token-mean loss, one
update per batch, seed, CPU. Held-out reward is measured by the same code for
both (Crucible's HF sampler on the 20 held-out problems, same temperature and seed) every
`--eval-every` steps, outside the timed window.

Cores: each side gets the machine's two. Crucible runs its learner and, beside it, its rollout
actor in a child process (`trainer.async_actor = "process"`, `max_async_steps = 1`: batch n
is sampled with the weights after update n - 1), one torch thread each. TRL's GRPOTrainer has
no rollout actor on CPU (its async paths need vLLM on a GPU), so a second core can only go to
its ops: it runs with one torch thread and with two, and the faster is the peer.

Figures (one process each, interleaved over `--repeats`, medians):
  steps_per_s       RL steps per second of training wall time (evals excluded)
  gen_tokens_per_s  completion tokens sampled per second of training wall time
  time_to_reward    training wall time until held-out reward >= `--threshold`; a side that
                    never reaches it counts its whole training time and the line says
                    "not reached in N s", the ratio then a bound (ratio< / ratio> / ratio~,
                    see tests/benchmarks/reward_time.py), never 0 or inf
  learner_idle      fraction of a step the learner waits for rollouts: Crucible k=0 (sync)
                    vs `max_async_steps` k=1, 2 with the rollout process (k=2's is quoted)
For information it also prints synchronous Crucible (k=0: one process, one thread, sampling
inline) against TRL on one thread. Crucible's rollouts and (stage 0, fp32) training forward
use its lean Qwen3-MoE forward (workers/rl/lean.py; the training forward packs each shared
prompt once and drops padding); TRL runs transformers' model and `generate` at their defaults
(sdpa attention, grouped_mm experts).
Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_rl` (needs the `rl`
and `bench` extras). Ends with DESIGN.md's lines:
    <figure>: crucible=<value> <peer>=<value> ratio=<crucible/peer> target=<op><value>
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.benchmarks.reward_time import median_time, reward_line
from workers.reporting import NullReporter
from workers.rl.distributed import process_group
from workers.rl.objectives import build_objective
from workers.rl.rollout import HFRollout
from workers.rl.sinks import NullSink
from workers.rl.spec import RunSpec, parse_spec
from workers.rl.tokenizer import load_tokenizer
from workers.rl.trainer import Trainer, train

PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE, LR = 8, 8, 4, 1.5, 1.5e-3
LAYERS, SFT_STEPS, EVAL_SAMPLES = 4, 250, 16


def base_spec(root: str, steps: int, eval_every: int, **trainer: Any) -> dict[str, Any]:
    return {
        "model": {"preset": {"num_layers": LAYERS}},
        "sft": {"steps": SFT_STEPS, "lr": 3e-3, "batch_size": 32},
        "rollout": {"group_size": GROUP, "max_new_tokens": NEW_TOKENS,
                    "temperature": TEMPERATURE},
        "algorithm": {"advantage": "grpo", "clip_low": 0.2, "clip_high": 0.2},
        "trainer": {"steps": steps, "prompts_per_step": PROMPTS,
                    "micro_batch_size": PROMPTS * GROUP, "zero_stage": 0, "lr": LR,
                    "schedule": "linear", "min_lr_ratio": 0.0, "seed": 0,
                    "eval_every": eval_every, "eval_samples": EVAL_SAMPLES, **trainer},
        "checkpoint": {"dir": root, "save_final": False},
        "output": {"stdout": False},
    }


def warm_start(root: Path) -> Path:
    """Crucible's SFT phase once; both engines start RL from `<root>/sft` (HF format)."""
    spec = parse_spec(base_spec(str(root), 1, 0))
    with process_group() as (rank, world):
        run = Trainer(spec, NullSink(), None, rank, world)
        return run.sft(run.tokenizer())


def rl_spec(sft: Path, root: str, steps: int, eval_every: int, **trainer: Any) -> RunSpec:
    data = base_spec(root, steps, eval_every, **trainer)
    data["model"] = {"source": "path", "path": str(sft)}
    data["tokenizer"] = {"source": "model"}
    data["sft"] = {"steps": 0}
    return parse_spec(data)


class ListSink(NullReporter):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "loss" in metrics:
            self.steps.append(metrics)


def first_reaching(curve: dict[int, float], times: dict[int, float], threshold: float) -> float:
    for step in sorted(curve):
        if step and curve[step] >= threshold:
            return times[step]
    return math.inf


def crucible(sft: Path, steps: int, eval_every: int, threshold: float,
             k: int = 0, actor: str = "thread") -> dict[str, float]:
    sink = ListSink()
    with tempfile.TemporaryDirectory() as root:
        res = train(rl_spec(sft, root, steps, eval_every, max_async_steps=k,
                            async_actor=actor if k else "thread"), sink)
    tokens = sum(m["completion_len"] * PROMPTS * GROUP for m in sink.steps)
    return {
        "steps_per_s": res.steps_per_s,
        "gen_tokens_per_s": tokens / res.train_time[steps],
        "time_to_reward": first_reaching(res.eval_reward, res.train_time, threshold),
        "learner_idle": statistics.mean(m["async/learner_idle"] for m in sink.steps),
        "final_reward": res.eval_reward[steps],
        "train_time": res.train_time[steps],
    }


def trl(sft: Path, steps: int, eval_every: int, threshold: float,
        threads: int = 1) -> dict[str, float]:
    """TRL's GRPOTrainer with `threads` torch intra-op threads (it has no rollout actor of
    its own on CPU: a second core can only go to its ops)."""
    torch.set_num_threads(threads)
    try:
        return trl_run(sft, steps, eval_every, threshold)
    finally:
        torch.set_num_threads(1)


def trl_run(sft: Path, steps: int, eval_every: int, threshold: float) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = rl_spec(sft, "unused", steps, eval_every)
    objective = build_objective(spec.task)
    tok = load_tokenizer(sft)
    model = AutoModelForCausalLM.from_pretrained(sft, local_files_only=True,
                                                 dtype=torch.float32)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.reference}
                              for e in objective.train])
    tokens = [0]

    def exact(completions, answer, completion_ids, **_):
        tokens[0] += sum(len(c) for c in completion_ids)
        return [float(c.split("\n")[0].strip() == a) for c, a in zip(completions, answer,
                                                                     strict=True)]

    def held_out(m) -> float:
        """The same measurement as Crucible's `Trainer.evaluate` (world of one)."""
        reps = [e for e in objective.eval for _ in range(EVAL_SAMPLES)]
        g = torch.Generator()
        g.manual_seed(hash((spec.trainer.seed, 30_000)) & 0x7FFF_FFFF_FFFF)
        batch = HFRollout(m, tok).generate([e.prompt for e in reps], spec.rollout, g)
        rewards, _ = objective.reward(reps, batch.texts)
        return sum(rewards) / len(rewards)

    curve: dict[int, float] = {}
    times: dict[int, float] = {}
    clock = {"start": 0.0, "evals": 0.0}

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            times[step] = time.perf_counter() - clock["start"] - clock["evals"]
            if step % eval_every == 0 or step == steps:
                t0 = time.perf_counter()
                curve[step] = held_out(model)
                clock["evals"] += time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP, max_completion_length=NEW_TOKENS, learning_rate=LR,
            lr_scheduler_type="linear", warmup_steps=0, beta=0.0, epsilon=0.2,
            temperature=TEMPERATURE, use_cpu=True, use_vllm=False, bf16=False,
            report_to=[], save_strategy="no", logging_steps=10**6, seed=0,
            disable_tqdm=True, loss_type="dapo", scale_rewards="group",
        )
        trainer = GRPOTrainer(model=model, reward_funcs=exact, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[Eval()])
        trainer.train()
    wall = times[steps]
    return {
        "steps_per_s": steps / wall,
        "gen_tokens_per_s": tokens[0] / wall,
        "time_to_reward": first_reaching(curve, times, threshold),
        "final_reward": curve[steps],
        "train_time": wall,
    }


def reward_summary(rows: list[dict[str, float]]) -> tuple[float, int]:
    return median_time([r["time_to_reward"] for r in rows], [r["train_time"] for r in rows])


def line(figure: str, ours: float, peer_name: str | None, peer: float | None,
         target: str, fmt: str = ".2f") -> str:
    if peer is None:
        return f"{figure}: crucible={ours:{fmt}} target={target}"
    ratio = f"{ours / peer:.2f}" if peer and math.isfinite(peer) else "n/a"
    return (f"{figure}: crucible={ours:{fmt}} {peer_name}={peer:{fmt}} ratio={ratio} "
            f"target={target}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.52,
                        help="held-out reward for time_to_reward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-steps", type=int, default=30,
                        help="steps of each k=0/1/2 learner-idle run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    os.environ["CRUCIBLE_THREADS"] = "1"  # the rollout process's torch threads too
    with tempfile.TemporaryDirectory() as tmp:
        sft = warm_start(Path(tmp) / "warm")
        ours: list[dict[str, float]] = []  # the headline: rollout process, k = 1
        sync: list[dict[str, float]] = []  # k = 0: one process, one thread, as TRL's default
        peer: dict[int, list[dict[str, float]]] = {1: [], 2: []}  # TRL by torch threads
        for _ in range(args.repeats):  # interleaved: the machine is shared and noisy
            ours.append(crucible(sft, args.steps, args.eval_every, args.threshold, k=1,
                                 actor="process"))
            sync.append(crucible(sft, args.steps, args.eval_every, args.threshold))
            for threads, rows in peer.items():
                rows.append(trl(sft, args.steps, args.eval_every, args.threshold, threads))
            print("crucible k=1 process", rounded(ours[-1]), flush=True)
            print("crucible k=0        ", rounded(sync[-1]), flush=True)
            for threads, rows in peer.items():
                print(f"trl {threads} thread(s)     ", rounded(rows[-1]), flush=True)
        idle: dict[int, list[float]] = {0: [], 1: [], 2: []}
        async_sps: dict[int, list[float]] = {0: [], 1: [], 2: []}
        for _ in range(args.repeats):
            for k in idle:
                r = crucible(sft, args.async_steps, 0, args.threshold, k=k, actor="process")
                idle[k].append(r["learner_idle"])
                async_sps[k].append(r["steps_per_s"])
                print(f"k={k}: learner_idle={r['learner_idle']:.3f} "
                      f"steps_per_s={r['steps_per_s']:.2f}", flush=True)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    # TRL's faster configuration is the peer: two cores each (Crucible's learner and rollout
    # processes, one thread each; TRL's ops on two threads), or TRL's one if two are slower.
    best = max(peer, key=lambda t: med(peer[t], "steps_per_s"))
    trl_rows = peer[best]
    print(f"held-out reward threshold for time_to_reward: {args.threshold}; "
          f"final reward crucible={med(ours, 'final_reward'):.3f} "
          f"(k=0: {med(sync, 'final_reward'):.3f}) trl={med(trl_rows, 'final_reward'):.3f} "
          f"after {args.steps} steps")
    print("trl steps/s by torch threads: " + ", ".join(
        f"{t}: {med(rows, 'steps_per_s'):.2f}" for t, rows in peer.items())
        + f"; the peer below is {best} thread(s)")
    print("learner_idle by max_async_steps (rollout process): " + ", ".join(
        f"k={k}: {statistics.median(v):.3f} ({statistics.median(async_sps[k]):.2f} steps/s)"
        for k, v in idle.items()))
    # For information: Crucible synchronous, one process on one thread, against TRL on one.
    print("sync (info): " + line("steps_per_s", med(sync, "steps_per_s"), "trl_1_thread",
                                 med(peer[1], "steps_per_s"), ">=2"))
    print(line("steps_per_s", med(ours, "steps_per_s"), "trl", med(trl_rows, "steps_per_s"),
               ">=3"))
    print(line("gen_tokens_per_s", med(ours, "gen_tokens_per_s"), "trl",
               med(trl_rows, "gen_tokens_per_s"), ">=2", ".1f"))
    print(reward_line(reward_summary(ours), reward_summary(trl_rows), args.repeats))
    print(line("learner_idle", statistics.median(idle[2]), "sync",
               statistics.median(idle[0]), "<=0.1", ".3f"))


def rounded(row: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in row.items()}

if __name__ == "__main__":
    main()
