"""4-bit gradient compression benchmark: bytes on the wire per step, and loss parity.

Trains the tiny Qwen3-MoE preset (built from a config, no download) with torch DDP on gloo, twice
from the same seed and the same batches: uncompressed (DDP's own fp32 all-reduce) and through the
4-bit comm hook with error feedback (workers/rl/grad_compress.py). The task is next-token
prediction on arithmetic progressions mod the vocabulary (learnable in context, so the loss
falls far below log(vocab) within 200 steps on CPU).

Figures:
  grad_bytes_per_step     bytes one rank sends per step through the 4-bit hook (payload +
                          scales, as counted by the hook), against a bandwidth-optimal fp32 /
                          bf16 all-reduce of the same gradient: 2 (W-1)/W N bytes-per-element
  cross_node_bytes_per_step  the same for a node leader in the hierarchical run (2 "nodes" x 2
                          ranks: fp32 inside the node, 4-bit between leaders)
  loss_final_diff         |mean loss over the last 20 steps, 4-bit - uncompressed|
  loss_curve_max_diff     max over steps of |smoothed 4-bit - smoothed uncompressed| (moving
                          average of 20 steps); parity tolerance 0.1 nats (PARITY_CURVE)
Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_grad_compress`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.rl import grad_compress as gc
from workers.rl.distributed import free_port, quiet_libraries

VOCAB, SEQ, BATCH, LR = 64, 24, 16, 3e-3
# Parity tolerances, in nats: the final loss (mean of the last SMOOTH steps) within 0.05, and the
# smoothed curves within 0.1 everywhere (2.4% of the starting loss log(64) = 4.16): in its
# steepest part the curve falls ~0.05 nats a step, so a one-step lag alone moves it that much.
SMOOTH, PARITY_FINAL, PARITY_CURVE = 20, 0.05, 0.1


def build_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from workers.rl.model import tiny_moe_config
    from workers.rl.spec import TinyMoeSpec

    cfg = tiny_moe_config(TinyMoeSpec(num_layers=2), VOCAB, pad_id=0, eos_id=1, aux_coef=0.01)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config.use_cache = False
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    """[BATCH, SEQ] token ids: x_k = (a + k d) mod VOCAB, a and d random per row."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    a = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    d = torch.randint(1, 6, (BATCH, 1), generator=g)
    return (a + d * torch.arange(SEQ)) % VOCAB


def worker(rank: int, world: int, port: int, mode: str, steps: int, out: str,
           nodes: list[int] | None) -> None:
    torch.set_num_threads(1)
    quiet_libraries()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = build_model(seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = None
        if mode == "4bit":
            plan = gc.NodePlan.build(nodes) if nodes else None
            state = gc.register(ddp, gc.HookState(plan=plan))
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        n_grad = sum(p.numel() for p in model.parameters() if p.requires_grad)
        losses, sent = [], []
        t0 = time.perf_counter()
        for step in range(steps):
            ids = batch(rank, step)
            if state is not None:
                state.reset_counts()
            loss = ddp(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if state is not None:
                assert state.elements == n_grad, (state.elements, n_grad)
                sent.append(state.counter.inter)
        elapsed = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(json.dumps({"losses": losses, "sent": sent, "n": n_grad,
                                             "s_per_step": elapsed / steps}))
    finally:
        dist.destroy_process_group()


def run(mode: str, steps: int, world: int = 2, nodes: list[int] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(worker, args=(world, free_port(), mode, steps, out, nodes), nprocs=world)
        return json.loads(Path(out).read_text())


def smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def line(figure: str, crucible: float, peer: str | None = None, value: float | None = None,
         target: str | None = None) -> str:
    parts = [f"{figure}: crucible={crucible:.6g}"]
    if peer is not None and value is not None:
        parts += [f"{peer}={value:.6g}", f"ratio={crucible / value:.4f}"]
    if target is not None:
        parts.append(f"target={target}")
    return " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hier-steps", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    plain = run("none", args.steps)
    comp = run("4bit", args.steps)
    hier = run("4bit", args.hier_steps, world=4, nodes=[0, 0, 1, 1])

    n = comp["n"]
    per_step = statistics.median(comp["sent"])
    fp32 = gc.uncompressed_all_reduce_bytes(n, 2, 4)
    bf16 = gc.uncompressed_all_reduce_bytes(n, 2, 2)
    cross = statistics.median(hier["sent"])  # rank 0 is node 0's leader
    cross_fp32 = gc.uncompressed_all_reduce_bytes(n, 2, 4)  # 2 leaders exchange
    s_plain, s_comp = smooth(plain["losses"]), smooth(comp["losses"])
    final_plain = statistics.fmean(plain["losses"][-SMOOTH:])
    final_comp = statistics.fmean(comp["losses"][-SMOOTH:])
    diffs = [abs(a - b) for a, b in zip(s_comp, s_plain, strict=True)]
    max_diff = max(diffs)
    at = diffs.index(max_diff)

    print(f"gradient elements: {n}; ranks: 2 (flat), 2 nodes x 2 (hierarchical); "
          f"steps: {args.steps}; s/step uncompressed {plain['s_per_step']:.3f}, "
          f"4-bit {comp['s_per_step']:.3f}")
    # on 2 ranks the all-reduce factor 2 (W-1)/W is 1: bytes sent per step / N is per element
    print(f"bytes sent per gradient element per step: {per_step / n:.4f} (4-bit, with padding "
          f"and scales) vs {fp32 / n:.0f} (fp32) vs {bf16 / n:.0f} (bf16)")
    print(f"loss: start {plain['losses'][0]:.4f}; final (mean of last {SMOOTH}) "
          f"uncompressed {final_plain:.4f}, 4-bit {final_comp:.4f}, "
          f"difference {final_comp - final_plain:+.4f}; smoothed-curve max difference "
          f"{max_diff:.4f} at step {at} (smoothed loss there {s_plain[at]:.3f}; tolerances: "
          f"final {PARITY_FINAL}, curve {PARITY_CURVE})")
    print(line("grad_bytes_per_step", per_step, "fp32", fp32, "<=0.15"))
    print(line("grad_bytes_per_step_vs_bf16", per_step, "bf16", bf16, "<=0.30"))
    print(line("cross_node_bytes_per_step", cross, "fp32", cross_fp32, "<=0.15"))
    print(line("loss_final_diff", abs(final_comp - final_plain), target=f"<={PARITY_FINAL}"))
    print(line("loss_curve_max_diff", max_diff, target=f"<={PARITY_CURVE}"))


if __name__ == "__main__":
    main()
