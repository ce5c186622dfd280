"""Int8 weight-only quantisation of a served model (`serve --int8`), for CPU serving.

Every projection weight (attention, dense MLPs, the output head, and the stacked expert tensors
of a Qwen3-MoE, which transformers 5 keeps as 3-D parameters rather than `nn.Linear`s) is
stored as int8 with one float32 scale per output row (symmetric, per channel):
`scale = max|w_row| / 127`, `q = round(w / scale)`. The residual stream, norms, attention and
router stay float32; a matmul reads the int8 weights through torch's own CPU kernel for
weight-only int8 (`aten._weight_int8pack_mm`; no extra dependency: torchao was not needed) on
bf16 copies of its inputs and scales its product in float32.

Why this and not `torch.ao` dynamic quantisation (`quantize_dynamic`): that replaces only
`nn.Linear`, so a MoE's experts (most of its weights) stay float32, and it quantises the
activations too (per tensor, 7 bits on x86), a larger error than bf16 inputs for the same speed
class; measured figures are in docs/serving.md ("Int8 weights"). `error_bound` states the
error of one matmul; the tests check it.

Norms, embeddings and the router stay in their dtype (small, and the router's choice of experts
is sensitive to its logits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127  # symmetric: -127..127, so -w and w round alike


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of `weight` (..., N, K): int8 values of the same shape and one
    float32 scale per row (..., N). A row of zeros gets scale 1 (its values are all 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale), -QMAX, QMAX).to(torch.int8)
    return q, scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights the int8 values and their row scales stand for."""
    return q.float() * scale.unsqueeze(-1)


# bf16's unit roundoff (8 significand bits, round to nearest): the CPU kernel reads its
# activations in bf16 and writes a bf16 product, accumulating in float32.
BF16_U = 2.0**-8


def error_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |x @ w.T - int8_linear(x, q, scale)| per output, for float32 weights `w` that
    `quantize_rows` turned into `q` (N, K) and `scale` (N,), inputs `x` (..., K):
    rounding the weights moves each by at most scale/2, so an output by (scale/2)·|x|_1; on
    CPU the kernel's bf16 inputs and output add at most 2u·sum_i |x_i||w'_ji| (u = 2^-8, with
    w' the dequantised weights), and float32 accumulation K·2^-24 of the same sum."""
    deq = dequantize_rows(q, scale).abs()  # (N, K)
    mag = x.abs().float() @ deq.T  # (..., N): sum_i |x_i||w'_ji|
    rounding = (2 * BF16_U + 2 * BF16_U**2 + (x.shape[-1] + 1) * 2.0**-24) * mag
    return x.abs().float().sum(dim=-1, keepdim=True) * (scale / 2) + rounding


@functools.cache
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ dequant(q, scale).T` for x (..., K), q (N, K) int8, scale (N,). On CPU: torch's
    weight-only int8 kernel (`aten._weight_int8pack_mm`) on bf16 inputs, its product widened
    back and scaled in float32 (the kernel's float32-input path measured slower than a float32
    matmul; the bf16 one about twice as fast, docs/serving.md); elsewhere the int8 weights are
    widened to x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and flat.shape[0] > 0:
        out = torch._weight_int8pack_mm(flat.to(torch.bfloat16).contiguous(), q,
                                        _ones(q.shape[0]))
        out = out.to(x.dtype) * scale.to(x.dtype)
    else:
        out = F.linear(flat, q.to(x.dtype)) * scale.to(x.dtype)
    return out.view(*x.shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """An `nn.Linear` with int8 per-row weights (buffers: they are not trained)."""

    int8_weights = True  # the RL engine's lean forward reads float weights: it steps aside
    qweight: torch.Tensor  # (out, in) int8
    scale: torch.Tensor  # (out,) float32

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("qweight", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))
        self.bias = linear.bias  # None, or the float bias as it was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int8_linear(x, self.qweight, self.scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Experts(nn.Module):
    """A Qwen3-MoE experts module (stacked `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I))
    with int8 per-row weights; computes what the float module's eager loop computes: each
    routed token through its experts, weighted by the router and summed."""

    int8_weights = True
    gate_up_q: torch.Tensor  # (E, 2I, H) int8
    gate_up_scale: torch.Tensor  # (E, 2I)
    down_q: torch.Tensor  # (E, H, I) int8
    down_scale: torch.Tensor  # (E, H)

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        float_experts: Any = experts  # transformers' Qwen3MoeExperts (untyped attributes)
        self.num_experts = int(float_experts.num_experts)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = float_experts.act_fn
        gate_up: torch.Tensor = float_experts.gate_up_proj
        down: torch.Tensor = float_experts.down_proj
        for name, w in (("gate_up", gate_up), ("down", down)):
            q, scale = quantize_rows(w)
            self.register_buffer(f"{name}_q", q.to(w.device))
            self.register_buffer(f"{name}_scale", scale.to(w.device))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden (T, H); top_k_index, top_k_weights (T, k)
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers' marker for a token routed nowhere
            token, slot = torch.where(top_k_index == e)
            x = hidden[token]
            gate, up = int8_linear(x, self.gate_up_q[e], self.gate_up_scale[e]).chunk(2, dim=-1)
            y = int8_linear(self.act_fn(gate) * up, self.down_q[e], self.down_scale[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def _is_stacked_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3 and hasattr(module, "num_experts"))


def quantize_model(model: nn.Module) -> dict[str, int]:
    """Replace, in place, every `nn.Linear` and every stacked-experts module of `model` with its
    int8 counterpart; returns counts of what was replaced. Refuses a model it would leave
    mostly in float (nothing to replace)."""
    counts = {"linear": 0, "experts": 0}
    targets: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                targets.append((parent, name, Int8Linear(child)))
                counts["linear"] += 1
            elif _is_stacked_experts(child):
                targets.append((parent, name, Int8Experts(child)))
                counts["experts"] += 1
    if not targets:
        raise ValueError(f"int8: {type(model).__name__} has no linear layers or stacked "
                         "experts to quantise")
    for parent, name, new in targets:
        setattr(parent, name, new)
    # An output head tied to the embeddings is now its own int8 copy; the embedding keeps
    # the float table (a lookup reads one row per token, nothing to gain).
    return counts


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear | Int8Experts) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each shared tensor once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
