"""RL engine benchmark: GRPO steps/s of Crucible's engine next to TRL's GRPOTrainer.

Same tiny Qwen3-MoE (random init from the preset), same BPE tokenizer, same batch (prompts x
generations), same completion length, one CPU process each, no reference model (beta 0).
Crucible's figure is its RL loop through DeepSpeed (ZeRO-0): rollouts, rewards, update, metrics,
engine setup excluded; TRL's is `trainer.train()` over the same number of steps (its own setup
inside train() included, amortised over the steps). Runs are interleaved, medians quoted.
Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_rl` (needs the `rl`
extra and `trl`). Ends with:
    <figure>: crucible=<value> trl=<value> ratio=<crucible/trl> target=<op><value>
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings

import torch

from workers.rl.model import build_policy
from workers.rl.sinks import NullSink
from workers.rl.spec import parse_spec
from workers.rl.tasks import build_task
from workers.rl.tokenizer import train_bpe
from workers.rl.trainer import train

PROMPTS, GROUP, NEW_TOKENS = 4, 8, 8


def spec_for(steps: int, root: str):
    return parse_spec({
        "model": {"preset": {"num_layers": 2}},
        "rollout": {"group_size": GROUP, "max_new_tokens": NEW_TOKENS},
        "trainer": {"steps": steps, "prompts_per_step": PROMPTS,
                    "micro_batch_size": PROMPTS * GROUP, "zero_stage": 0},
        "checkpoint": {"dir": root, "save_final": False},
        "output": {"stdout": False},
    })


def crucible(steps: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        return train(spec_for(steps, root), NullSink()).steps_per_s


def trl(steps: int) -> float:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    spec = spec_for(steps, "unused")
    task = build_task(spec.task)
    tok = train_bpe(task.corpus(), spec.tokenizer.vocab_size)
    model = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.reference} for e in task.train])

    def exact(completions, answer, **_):
        return [float(c.split("\n")[0].strip() == a) for c, a in zip(completions, answer,
                                                                     strict=True)]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP, max_completion_length=NEW_TOKENS, learning_rate=1e-3,
            beta=0.0, temperature=1.0, use_cpu=True, use_vllm=False, bf16=False,
            report_to=[], save_strategy="no", logging_steps=10**6, seed=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=exact, args=args, train_dataset=data,
                              processing_class=tok)
        t0 = time.perf_counter()
        trainer.train()
        return steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    ours, peer = [], []
    for _ in range(args.repeats):  # interleaved: the machine is shared and noisy
        ours.append(crucible(args.steps))
        peer.append(trl(args.steps))
        print(f"crucible {ours[-1]:.2f} steps/s  trl {peer[-1]:.2f} steps/s", flush=True)
    c, t = statistics.median(ours), statistics.median(peer)
    samples = PROMPTS * GROUP
    print(f"grpo_steps_per_s: crucible={c:.2f} trl={t:.2f} ratio={c / t:.2f} target=>=1.0")
    print(f"grpo_samples_per_s: crucible={c * samples:.1f} trl={t * samples:.1f} "
          f"ratio={c / t:.2f} target=>=1.0")


if __name__ == "__main__":
    main()
