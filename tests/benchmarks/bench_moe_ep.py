"""Expert parallelism benchmark: 2-rank EP (each rank holds half the experts, tokens moved by
all-to-all) against 2-rank data parallelism only (every rank holds all experts, all grads
all-reduced), same tiny Qwen3-MoE preset, same per-rank batch, same optimizer, same ranks.

The DP baseline runs the same expert code (the EP block with EP size 1: all experts local,
no exchange), so the ratio isolates what sharding costs or saves. A third, informational
figure is DP with transformers' own experts forward (its default `grouped_mm` path), to show
the per-expert loop both of the others use is not a handicap or a head start.

One spawned world of 2 gloo ranks builds both models from the same seed and times training
steps (forward, cross-entropy + router aux loss, backward, gradient sync, AdamW step) of each
in turn, alternating which goes first, over `--repeats` rounds; the figure is the median
round's tokens/s per rank (a round's time is rank 0's, between barriers, so it covers the
slower rank).

Caveat: on a 2-core CPU host both ranks share the cores and the "network" is loopback, so
this measures EP's communication and bookkeeping overhead (two all-to-alls per MoE layer
and their backward, plus small count exchanges) against one gradient all-reduce; it does
not show EP's point, which is memory: each rank stores, updates and keeps optimizer state for
only its experts (the second figure).

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_moe_ep` (`make
bench-moe-ep`). Ends with DESIGN.md's lines:
    ep_tokens_per_s_per_rank: crucible=<ep> dp=<dp> ratio=<ep/dp>
    expert_param_bytes_per_rank: crucible=<ep> dp=<dp> ratio=<ep/dp>

`--trainer` measures the whole trainer instead (`moe.expert_parallel` through DeepSpeed ZeRO-2,
under torchrun, `--nproc` ranks; gloo on CPU, NCCL where each rank has a GPU): the same RL run
with EP = nproc against EP = 1, reading the trainer's own `train_tokens_per_s` (forward,
backward and optimizer step of the RL update; sampling excluded) and steps/s. Prints
    ep_trainer_tokens_per_s_per_rank: crucible=<ep> dp=<dp> ratio=<ep/dp>
    <prefix>ep_train_steps_per_s: crucible=<ep> dp=<dp> ratio=<ep/dp>
"""

from __future__ import annotations

import argparse
import datetime
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

from workers.rl import expert_parallel as ep
from workers.rl.distributed import free_port, quiet_libraries
from workers.rl.model import build_policy
from workers.rl.spec import ModelSpec, TinyMoeSpec

WORLD = 2
VOCAB = 256
AUX_COEF = 0.01


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
          sync: Any) -> None:
    out = model(input_ids=ids, output_router_logits=True)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                             ids[:, 1:].reshape(-1)) + AUX_COEF * out.aux_loss
    loss.backward()
    sync(model)
    opt.step()
    opt.zero_grad(set_to_none=False)


def _rank_main(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    quiet_libraries()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    try:
        spec = ModelSpec(seed=1, router_aux_loss_coef=AUX_COEF, preset=TinyMoeSpec())
        hf_model = build_policy(spec, VOCAB, 0, 1)
        dp_model = build_policy(spec, VOCAB, 0, 1)
        ep_model = build_policy(spec, VOCAB, 0, 1)
        layout = ep.make_layout(WORLD)
        ep.shard_experts(ep_model, layout)
        ep.shard_experts(dp_model, ep.make_layout(1))  # same expert code, all experts local
        models = {
            "ep": (ep_model, lambda m: ep.sync_gradients(m, layout)),
            "dp": (dp_model, lambda m: ep.all_reduce_gradients(m, WORLD)),
            "dp_hf": (hf_model, lambda m: ep.all_reduce_gradients(m, WORLD)),
        }
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
                for k, (m, _) in models.items()}
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
        batches = [torch.randint(2, VOCAB, (args.batch, args.seq), generator=g)
                   for _ in range(args.steps)]
        for k, (m, sync) in models.items():  # warm-up: allocator, first collectives
            for ids in batches[:args.warmup]:
                _step(m, opts[k], ids, sync)
        times: dict[str, list[float]] = {k: [] for k in models}
        order = list(models)
        for rep in range(args.repeats):
            for k in order[rep % len(order):] + order[:rep % len(order)]:  # rotate who starts
                m, sync = models[k]
                dist.barrier()
                t0 = time.perf_counter()
                for ids in batches:
                    _step(m, opts[k], ids, sync)
                dist.barrier()
                times[k].append(time.perf_counter() - t0)
        if rank == 0:
            Path(out).write_text(json.dumps({
                "times": times,
                "expert_bytes": {"ep": ep.expert_parameter_bytes(ep_model),
                                 "dp": ep.expert_parameter_bytes(dp_model)},
                "params": {"ep": sum(p.numel() for p in ep_model.parameters()),
                           "dp": sum(p.numel() for p in dp_model.parameters())},
            }))
    finally:
        dist.destroy_process_group()


TRAINER_CONFIG = """
name = "bench-ep"
[model]
seed = 3
[model.preset]
num_layers = 4
num_experts = 8
hidden_size = {hidden}
moe_intermediate_size = {hidden}
[sft]
steps = 0
[rollout]
group_size = 8
max_new_tokens = 16
[moe]
expert_parallel = {ep}
[trainer]
steps = {steps}
prompts_per_step = {prompts}
micro_batch_size = 16
zero_stage = 2
precision = "{precision}"
seed = 7
[checkpoint]
dir = "{dir}/ckpt"
save_final = false
[output]
metrics_jsonl = "{dir}/metrics.jsonl"
stdout = false
"""


def trainer_run(run_dir: Path, ep_size: int, nproc: int, args: argparse.Namespace
                ) -> dict[str, float]:
    """One torchrun of the trainer; medians of its per-step figures past the first two."""
    import subprocess
    import sys

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "run.toml"
    cfg.write_text(TRAINER_CONFIG.format(
        ep=ep_size, steps=args.trainer_steps, prompts=2 * nproc, dir=run_dir,
        hidden=args.hidden, precision="bf16" if torch.cuda.is_available() else "fp32"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "workers.rl", "train", "--config", str(cfg)]
    log = run_dir / "log.txt"
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"trainer run failed (exit {rc}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in rows if r["kind"] == "metrics" and "loss" in r["metrics"]][2:]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)]
    return {"tokens_per_s_per_rank": statistics.median(
                r["metrics"]["train_tokens_per_s"] for r in steps) / nproc,
            "steps_per_s": 1.0 / statistics.median(gaps)}


def trainer_main(args: argparse.Namespace) -> None:
    """EP = nproc against EP = 1 through the whole trainer (see the module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        ep_res = trainer_run(Path(d) / "ep", args.nproc, args.nproc, args)
        dp_res = trainer_run(Path(d) / "dp", 1, args.nproc, args)
    device = "NCCL on GPUs" if torch.cuda.is_available() else "gloo on CPU"
    print(f"trainer, tiny Qwen3-MoE preset (8 experts, 4 layers, hidden {args.hidden}), "
          f"{args.nproc} ranks, {device}, ZeRO-2, {args.trainer_steps} RL steps (first 2 "
          f"excluded), EP={args.nproc} against EP=1")
    e, p = ep_res["tokens_per_s_per_rank"], dp_res["tokens_per_s_per_rank"]
    print(f"ep_trainer_tokens_per_s_per_rank: crucible={e:.0f} dp={p:.0f} ratio={e / p:.2f}")
    e, p = ep_res["steps_per_s"], dp_res["steps_per_s"]
    print(f"{args.prefix}ep_train_steps_per_s: crucible={e:.2f} dp={p:.2f} ratio={e / p:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", action="store_true",
                    help="measure the trainer with moe.expert_parallel (torchrun) instead")
    ap.add_argument("--nproc", type=int, default=2, help="--trainer: ranks (= EP size)")
    ap.add_argument("--trainer-steps", type=int, default=8, help="--trainer: RL steps per run")
    ap.add_argument("--hidden", type=int, default=64, help="--trainer: hidden / expert size")
    ap.add_argument("--prefix", default="", help="--trainer: figure name prefix (gpu_)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds (medians are quoted)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks: one thread each
    if args.trainer:
        trainer_main(args)
        return
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        mp.spawn(_rank_main, args=(free_port(), args, str(out)), nprocs=WORLD, join=True)
        res = json.loads(out.read_text())
    tokens = args.steps * args.batch * args.seq  # per rank per round
    tps = {k: tokens / statistics.median(v) for k, v in res["times"].items()}
    eb = res["expert_bytes"]
    print(f"tiny Qwen3-MoE preset (8 experts, top-2, 4 layers), {WORLD} gloo ranks on CPU, "
          f"{args.batch}x{args.seq} tokens per rank per step, {args.steps} steps x "
          f"{args.repeats} rounds; parameters per rank: ep={res['params']['ep']} "
          f"dp={res['params']['dp']}")
    print("round tokens/s per rank: " + "; ".join(
        f"{k}=" + ",".join(f"{tokens / t:.0f}" for t in v) for k, v in res["times"].items()))
    print("caveat: 2 ranks share this host's CPU cores over loopback, so this measures EP's "
          "communication overhead, not its memory win (expert bytes below)")
    print(f"ep_tokens_per_s_per_rank: crucible={tps['ep']:.0f} dp={tps['dp']:.0f} "
          f"ratio={tps['ep'] / tps['dp']:.2f}")
    print(f"expert_param_bytes_per_rank: crucible={eb['ep']} dp={eb['dp']} "
          f"ratio={eb['ep'] / eb['dp']:.2f}")
    print(f"info: ep_tokens_per_s_per_rank against DP with transformers' experts forward: "
          f"crucible={tps['ep']:.0f} dp_hf={tps['dp_hf']:.0f} "
          f"ratio={tps['ep'] / tps['dp_hf']:.2f}")


if __name__ == "__main__":
    main()
