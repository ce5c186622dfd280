"""Engine set-up: the DeepSpeed ZeRO engine every training phase (SFT, preference, RL) trains
on, its optimizer and LR schedule, and the weight copies the rollout side reads.

Kept apart from the training loop so the phases share one construction path and the loop
reads as steps, not configuration.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from workers.rl.distributed import on_cuda
from workers.rl.flat_adamw import FlatAdamW
from workers.rl.spec import TrainerSpec


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then
    cosine or linear decay to `min_ratio`, or constant."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1 - min_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def use_bf16(ts: TrainerSpec) -> bool:
    """Whether the engine (and the frozen copies that must match it) computes in bf16."""
    if ts.precision == "auto":
        return on_cuda() and torch.cuda.is_bf16_supported()
    return ts.precision == "bf16"


def make_engine(model: torch.nn.Module, ts: TrainerSpec, lr: float, total_steps: int,
                micro: int, gas: int, own_clip: bool = False) -> Any:
    """A DeepSpeed engine over `model` with AdamW and the `ts` LR schedule over `total_steps`
    optimizer steps, `micro` sequences per micro-batch and `gas` micro-batches per step.

    `own_clip`: a stage-0 engine in a world of one leaves gradient clipping to the caller's
    `clip_gradients` (the same arithmetic, bit for bit, without DeepSpeed's per-tensor loop and
    its all-reduce of the norm); `engine.crucible_clip` holds the bound, 0 where DeepSpeed
    clips."""
    import deepspeed
    from deepspeed.moe.utils import (
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": params}]
    if any(is_moe_param(p) for p in params):
        # Expert shards (workers/rl/expert_parallel.py): one optimizer group per DeepSpeed
        # expert group, which ZeRO partitions and reduces over that group's ranks only.
        groups = split_params_into_different_moe_groups_for_optimizer(
            [{"params": params, "name": "dense"}])
    foreach = adamw_impl(params).get("foreach")
    opt: torch.optim.Optimizer
    if (foreach and len(groups) == 1 and ts.zero_stage == 0 and not use_bf16(ts)
            and all(p.device.type == "cpu" for p in params)):
        # Stage 0 steps this optimizer itself: on CPU the flat one (bit-identical, fewer
        # kernels). ZeRO stages and bf16 wrap it in their own flat fp32 groups.
        opt = FlatAdamW(groups, lr=lr, weight_decay=ts.weight_decay)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=ts.weight_decay, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, total_steps, ts.warmup_steps, ts.schedule, ts.min_lr_ratio),
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    clip_here = own_clip and ts.zero_stage == 0 and world == 1 and ts.grad_clip > 0
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0 if clip_here else ts.grad_clip,
        "zero_optimization": {"stage": ts.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": use_bf16(ts)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ts.zero_stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    config["zero_optimization"].update(zeropp_config(ts, on_cuda()))
    if on_cuda() and os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=config
    )
    if ts.grad_compression == "4bit" and engine.world_size > 1:
        from workers.rl.grad_compress import attach_to_deepspeed

        attach_to_deepspeed(engine)
    if ts.zero_stage == 0 and engine.world_size == 1:
        # In a world of one the stage-0 gradient all-reduce is an identity that still
        # flattens every gradient into a bucket, reduces it and copies it back each step.
        engine.enable_backward_allreduce = False
    engine.crucible_clip = ts.grad_clip if clip_here else 0.0
    return engine


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT builder can read it. It parses each entry as
    numbers (with an optional ``+PTX``), so an arch-specific entry such as ``9.0a``, which some
    CUDA images set, fails every JIT-built op (ZeRO++'s quantiser: "invalid literal for int()
    with base 10: '0a'"). Seen on an H200 image; ``9.0a`` becomes ``9.0``."""
    out: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        m = re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", entry.strip())
        fixed = f"{m[1]}.{m[2]}{m[3] or ''}" if m else entry.strip()
        if fixed and fixed not in out:
            out.append(fixed)
    return ";".join(out)


class ZeroPPUnavailable(ValueError):
    """ZeRO++ quantisation asked for where DeepSpeed cannot run it."""


def zeropp_config(ts: TrainerSpec, cuda: bool) -> dict[str, Any]:
    """`trainer.zeropp` as DeepSpeed `zero_optimization` keys. Refused on CPU for qwZ/qgZ:
    DeepSpeed would start and then fail inside the first all-gather ("not implemented on CPU
    backend"); saying so before the run starts is the useful error."""
    zp = ts.zeropp
    if (zp.quantized_weights or zp.quantized_gradients) and not cuda:
        raise ZeroPPUnavailable("ZeRO++ quantisation needs a GPU: trainer.zeropp."
                                "quantized_weights / quantized_gradients have no CPU kernels in "
                                "DeepSpeed; use trainer.grad_compression = '4bit' (zero_stage 0) "
                                "on CPU")
    out: dict[str, Any] = {}
    if zp.quantized_weights:
        out["zero_quantized_weights"] = True
    if zp.quantized_gradients:
        out["zero_quantized_gradients"] = True
    if zp.hpz_partition_size > 1:
        out["zero_hpz_partition_size"] = zp.hpz_partition_size
    return out


def clip_gradients(engine: Any) -> float | None:
    """Clip the accumulated gradients to `engine.crucible_clip` as DeepSpeed's stage-0
    `clip_grad_norm_` does in a world of one (per-tensor 2-norms, their root sum of squares,
    coefficient min(1, bound / (norm + 1e-6)) applied to every gradient), with multi-tensor
    ops. Call before the accumulation boundary's `engine.step()`. Returns the norm, or None
    where DeepSpeed clips."""
    bound = getattr(engine, "crucible_clip", 0.0)
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not bound or not grads:
        return None
    total = torch.stack(torch._foreach_norm(grads, 2.0)).pow(2.0).sum().float().pow(0.5)
    coef = torch.tensor([float(bound)], device=total.device) / (total + 1e-6)
    coef = torch.min(torch.tensor([1.0], device=coef.device), coef)
    torch._foreach_mul_(grads, coef.reshape(()))
    return float(total)


def adamw_impl(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """torch's multi-tensor (foreach) AdamW where the parameters are dense float tensors: a few
    ops over all tensors instead of a dozen per tensor (torch picks it by default on CUDA only),
    with bit-identical results. Not the fused kernel (about 0.5 ms less per CPU benchmark step):
    its rounding differs, and on the tiny models the SFT warm start and the RL curve move with
    float noise (with it in the RL phase the proof-of-learning run ended +0.19, not +0.275)."""
    if params and all(p.is_floating_point() and p.layout == torch.strided for p in params):
        return {"foreach": True}
    return {}


def weight_snapshot(module: torch.nn.Module, zero_stage: int, merged: bool = False,
                    clone: bool = True) -> dict[str, torch.Tensor]:
    """A copy of the policy's weights for the rollout side (collective under ZeRO-3): all of
    them, or for a LoRA policy its adapters only (the rollout copy is a peft model on the same
    frozen base), or with `merged` the full merged weights a plain model needs (vLLM).
    `clone=False`: a plain policy's own tensors, for a receiver that copies them at once."""
    import deepspeed

    from workers.rl import expert_parallel, lora

    ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
           if zero_stage == 3 else contextlib.nullcontext())
    with ctx:
        if expert_parallel.is_sharded(module):  # collective: the EP group's shards gathered
            return expert_parallel.gathered_state_dict(module)
        if lora.is_lora(module):
            return lora.merged_state(module) if merged else lora.adapter_state(module)
        state = module.state_dict()
        return {k: v.detach().clone() for k, v in state.items()} if clone else state




def frozen_copy(model: torch.nn.Module, device: torch.device, bf16: bool = False
                ) -> torch.nn.Module:
    """A gradient-free copy of `model` in eval mode (the KL / DPO reference): taken before the
    engine wraps the policy, so it holds the phase's starting weights."""
    ref = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    return ref.to(torch.bfloat16) if bf16 else ref
