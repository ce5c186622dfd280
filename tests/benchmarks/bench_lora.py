"""LoRA RL against full fine-tuning: what the learner holds and how long its update takes.

Both sides are built by Crucible's own path (`build_policy`, `make_engine`: DeepSpeed stage 0,
AdamW, a world of one, fp32 on CPU), from the same seeded Qwen3-MoE preset, and take the same
RL update on the same batch: a reference forward for the KL term, the policy forward, a
policy-gradient loss with a k3 KL penalty, backward, clipping, the optimizer step. Full
fine-tuning's reference is a frozen copy of the policy (what the trainer builds today); LoRA's is
the same module with its adapters off (`AdaptersOff`), so it holds no copy.

Memory is counted, not sampled: parameter bytes (including the reference copy), gradient bytes
and AdamW state bytes, from the tensors themselves (a process's RSS on a shared 2-core host
mixes in allocator caches and library code; the counted bytes are what scales with the model).
Step time is the median of `--steps` timed updates per side, sides alternating, after warm-up.
A last figure runs the whole RL loop (`train`: sampling with the hf backend, reward, update,
KL against the reference) on the tiny preset, `--rl-steps` steps per side, sides alternating
over `--rl-rounds` rounds, and quotes the median steps/s; sampling dominates there.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_lora` (`make
bench-lora`). Ends with DESIGN.md's lines (one set per preset, the larger one suffixed `_m`):
    lora_trainable_params: crucible=<lora> full=<full> ratio=<lora/full>
    lora_optimizer_state_bytes: crucible=<lora> full=<full> ratio=<lora/full>
    lora_learner_bytes: crucible=<lora> full=<full> ratio=<lora/full>
    lora_step_s: crucible=<lora> full=<full> ratio=<lora/full>
    lora_rl_steps_per_s: crucible=<lora> full=<full> ratio=<lora/full>
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workers.rl.distributed import process_group
from workers.rl.engine import clip_gradients, frozen_copy, make_engine
from workers.rl.lora import AdaptersOff
from workers.rl.model import build_policy
from workers.rl.spec import LoraSpec, ModelSpec, TinyMoeSpec, TrainerSpec, parse_spec
from workers.rl.trainer import train

VOCAB = 256
PRESETS: dict[str, TinyMoeSpec] = {
    "": TinyMoeSpec(),  # the default tiny MoE: 4 layers, hidden 64, 8 experts top-2
    "_m": TinyMoeSpec(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=32,
                      num_experts=16, experts_per_token=2, moe_intermediate_size=256),
}


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build(preset: TinyMoeSpec, lora: bool, steps: int) -> tuple[Any, torch.nn.Module]:
    spec = ModelSpec(preset=preset, seed=1, lora=LoraSpec() if lora else None)
    policy = build_policy(spec, VOCAB, 0, 1)
    ref = AdaptersOff(policy) if lora else frozen_copy(policy, torch.device("cpu"))
    ts = TrainerSpec(zero_stage=0, grad_clip=1.0)
    return make_engine(policy, ts, 1e-4, steps, 8, 1, own_clip=True), ref


def update(engine: Any, ref: torch.nn.Module, ids: torch.Tensor, adv: torch.Tensor,
           prompt: int) -> float:
    """One RL update: completion log-probs under policy and reference, PG + k3 KL, a step."""
    t0 = time.perf_counter()
    tgt = ids[:, prompt:]  # (B,C) completion tokens
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(input_ids=ids).logits[:, prompt - 1:-1], -1)
        ref_lp = ref_lp.gather(-1, tgt[..., None])[..., 0]  # (B,C)
    logits = engine(input_ids=ids).logits[:, prompt - 1:-1]  # (B,C,V)
    lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
    ratio = torch.exp(lp - lp.detach())
    kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
    loss = (-(ratio * adv[:, None]) + 0.05 * kl).mean()
    engine.backward(loss)
    clip_gradients(engine)
    engine.step()
    return time.perf_counter() - t0


def measure(preset: TinyMoeSpec, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (16, 48), generator=g)  # 16 sequences: 16 prompt + 32 new
    adv = torch.randn(16, generator=g)
    sides = {name: build(preset, name == "lora", steps + warmup) for name in ("lora", "full")}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(steps + warmup):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            t = update(*sides[name], ids, adv, 16)
            if i >= warmup:
                times[name].append(t)
    out: dict[str, dict[str, float]] = {}
    for name, (engine, ref) in sides.items():
        params = list(engine.module.parameters())
        trainable = [p for p in params if p.requires_grad]
        opt_state = [t for s in engine.optimizer.state.values() for t in s.values()]
        ref_bytes = nbytes(ref.parameters())  # LoRA's AdaptersOff owns none
        grads = [p.grad for p in trainable if p.grad is not None]
        out[name] = {
            "trainable": sum(p.numel() for p in trainable),
            "total": sum(p.numel() for p in params),
            "opt": nbytes(opt_state),
            "learner": nbytes(params) + ref_bytes + nbytes(grads) + nbytes(opt_state),
            "ref": ref_bytes,
            "step_s": statistics.median(times[name]),
        }
    return out


def rl_steps_per_s(lora: bool, steps: int, root: Path) -> float:
    """steps/s of a whole tiny RL run (no SFT warm start, no checkpoints, no evaluation
    beyond the run's own start and end)."""
    data: dict[str, Any] = {
        "model": {"lora": {}} if lora else {},
        "sft": {"steps": 0},
        "algorithm": {"kl_coef": 0.05},
        "rollout": {"group_size": 4, "max_new_tokens": 16},
        "trainer": {"steps": steps, "prompts_per_step": 4, "micro_batch_size": 16},
        "checkpoint": {"dir": str(root), "every": 0, "save_final": False},
        "output": {"stdout": False},
    }
    return train(parse_spec(data)).steps_per_s


def line(figure: str, lora: float, full: float, fmt: str = "{:.0f}") -> str:
    return (f"{figure}: crucible={fmt.format(lora)} full={fmt.format(full)} "
            f"ratio={lora / full:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed updates per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--small-only", action="store_true", help="skip the larger preset")
    ap.add_argument("--rl-steps", type=int, default=10, help="RL steps per whole-loop run")
    ap.add_argument("--rl-rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("CRUCIBLE_THREADS", "1")))
    lines: list[str] = []
    with process_group():
        for suffix, preset in PRESETS.items():
            if suffix and args.small_only:
                continue
            r = measure(preset, args.steps, args.warmup)
            lo, fu = r["lora"], r["full"]
            print(f"preset{suffix or ' (tiny)'}: hidden {preset.hidden_size}, "
                  f"{preset.num_layers} layers, {preset.num_experts} experts top-"
                  f"{preset.experts_per_token}; {fu['total']:.0f} base parameters; LoRA r=8 "
                  f"on q/k/v/o_proj; full FT's reference copy {fu['ref']:.0f} bytes, LoRA's 0")
            lines += [
                line(f"lora_trainable_params{suffix}", lo["trainable"], fu["trainable"]),
                line(f"lora_optimizer_state_bytes{suffix}", lo["opt"], fu["opt"]),
                line(f"lora_learner_bytes{suffix}", lo["learner"], fu["learner"]),
                line(f"lora_step_s{suffix}", lo["step_s"], fu["step_s"], "{:.4f}"),
            ]
    rl: dict[str, list[float]] = {"lora": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rl_rounds):
            for name in (("lora", "full") if i % 2 == 0 else ("full", "lora")):
                rl[name].append(rl_steps_per_s(name == "lora", args.rl_steps,
                                               Path(tmp) / f"{name}{i}"))
    print("whole-loop steps/s per round: " + "; ".join(
        f"{k} " + ", ".join(f"{v:.2f}" for v in vs) for k, vs in rl.items()))
    lines.append(line("lora_rl_steps_per_s", statistics.median(rl["lora"]),
                      statistics.median(rl["full"]), "{:.2f}"))
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
    for s in lines:
        print(s)


if __name__ == "__main__":
    main()
