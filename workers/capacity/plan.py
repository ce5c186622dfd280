"""Capacity planning: from a model's shape, a concurrency and a context length, the memory
a serving replica needs (weights per dtype, KV cache, prefill activations), the bytes a
decode step reads, and which tensor/expert-parallel layouts of a GPU type hold it.

Every figure is a closed-form estimate (docs/capacity.md gives the formulas): exact for
weights and KV cache, an upper-bound working set for activations, and a bandwidth-only
ceiling for decode speed (it ignores compute, communication and kernel efficiency, so real
engines reach some fraction of it). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workers.capacity.gpus import GPUS, Gpu
from workers.capacity.shapes import ModelShape

#: Bytes per parameter of the quantisable linear layers (attention, MLPs, experts). Scales
#: of int4/int8/fp8 checkpoints (one per group or channel) are left out: ~3% at int4 with
#: groups of 128, under 1% otherwise. Embeddings, lm_head, norms and routers stay bf16.
WEIGHT_BYTES: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}
ACT_BYTES = 2  # activations in bf16
LOGIT_BYTES = 4  # the sampler's logits in fp32
#: Tensor-parallel sizes tried: up to one node's NVLink domain.
TP_SIZES = (1, 2, 4, 8)
DEFAULT_HEADROOM = 0.10
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_MAX_GPUS = 64


@dataclass(frozen=True)
class Request:
    """What to plan for. ``concurrency`` sequences decode together, each holding
    ``context`` tokens (prompt plus output) in the KV cache."""

    concurrency: int
    context: int
    gpu: str = "H100-80GB"
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    headroom: float = DEFAULT_HEADROOM
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_gpus: int = DEFAULT_MAX_GPUS

    def __post_init__(self) -> None:
        # The API validates first; these guard direct callers with the same words.
        for name in ("concurrency", "context", "prefill_chunk", "max_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive whole number")
        if self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {', '.join(GPUS)}")
        if self.dtype not in WEIGHT_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(WEIGHT_BYTES)}")
        if self.kv_dtype not in KV_BYTES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_BYTES)}")
        if not 0 <= self.headroom < 1:
            raise ValueError("headroom must be a fraction in [0, 1)")


# --- the model on its own ------------------------------------------------------------------


def weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Weights in memory: the linear layers at ``dtype``, the rest in bf16."""
    p = shape.params()
    return round(p.quantisable * WEIGHT_BYTES[dtype] + p.kept_bf16 * 2)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bf16") -> int:
    """KV cache one token adds, summed over layers (sliding-window layers included: a
    token is cached there too until it leaves the window)."""
    return shape.num_layers * shape.kv_elements_per_token_layer() * KV_BYTES[kv_dtype]


def kv_bytes_per_sequence(shape: ModelShape, context: int, kv_dtype: str = "bf16") -> int:
    """KV cache of one sequence of ``context`` tokens: full-attention layers hold every
    token, a sliding-window layer at most its window."""
    per_layer = shape.kv_elements_per_token_layer() * KV_BYTES[kv_dtype]
    return sum(per_layer * (context if w is None else min(context, w)) for w in shape.windows)


def prefill_activation_bytes(shape: ModelShape, chunk: int) -> int:
    """Peak transient activations of one layer's forward over a prefill chunk of ``chunk``
    tokens (inference keeps no activations between layers, and flash attention builds no
    chunk x context score matrix): the residual stream and its normed copy, plus the
    larger of the attention block's q/k/v/output and the MLP's gate/up/product (for MoE:
    each token's top-k expert copies and the fp32 router logits)."""
    h = shape.hidden_size
    if shape.mla is not None:
        m = shape.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        attn = shape.num_heads * (2 * qk + 2 * m.v_head_dim)
    else:
        attn = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim \
            + shape.num_heads * shape.head_dim
    stages = [chunk * (2 * h + attn) * ACT_BYTES]
    if shape.num_dense_layers:
        stages.append(chunk * (2 * h + 3 * shape.intermediate_size) * ACT_BYTES)
    if shape.moe is not None and shape.num_moe_layers:
        m2 = shape.moe
        stages.append(chunk * (2 * h + m2.experts_per_token * 3 * m2.expert_intermediate
                               + 3 * m2.shared_intermediate) * ACT_BYTES
                      + chunk * m2.num_experts * LOGIT_BYTES)
    return max(stages)


def logits_bytes(shape: ModelShape, concurrency: int) -> int:
    """The sampler's fp32 logits for one decode step of the whole batch."""
    return concurrency * shape.vocab_size * LOGIT_BYTES


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a decode step's ``tokens`` tokens reach in one MoE layer, under
    uniform routing: each expert is missed by one token with probability 1 - k/E."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def decode_weight_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """Weights one sequence's decode step reads: every dense part, the lm_head, one
    embedding row, and only the ``k`` routed experts of each MoE layer."""
    p = shape.params()
    q = WEIGHT_BYTES[dtype]
    expert_quant = 0
    if shape.moe is not None:
        expert_quant = shape.num_moe_layers * shape.moe.experts_per_token \
            * shape.expert_params()
    quant = p.attention + p.dense_mlp + p.shared_experts + expert_quant
    kept = p.lm_head + shape.hidden_size + p.router + p.norms
    if shape.tie_word_embeddings:  # the tied table is read whole as the lm_head
        kept += p.embedding - shape.hidden_size
    return round(quant * q + kept * 2)


# --- layouts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """``tp`` GPUs hold one copy of the attention and dense weights (tensor parallel);
    ``dp`` such groups split the sequences between them; experts are either split by
    tensor parallelism inside each group (``ep`` = 1) or spread whole over all
    ``tp * dp`` GPUs (expert parallel, ``ep`` = tp * dp)."""

    tp: int
    dp: int
    ep: int

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


@dataclass
class LayoutPlan:
    layout: Layout
    valid: bool
    reason: str = ""
    weights_per_gpu: int = 0
    kv_per_gpu: int = 0
    activations_per_gpu: int = 0
    usable_per_gpu: int = 0
    fits: bool = False
    decode_bytes_per_step: int = 0  # read by the busiest GPU in one decode step
    decode_tokens_s: float = 0.0  # all sequences together, bandwidth-bound ceiling
    decode_tokens_s_per_seq: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total_per_gpu(self) -> int:
        return self.weights_per_gpu + self.kv_per_gpu + self.activations_per_gpu


def tp_problem(shape: ModelShape, tp: int, expert_parallel: bool) -> str:
    """Why ``tp`` cannot split this model's attention or MLPs ('' when it can)."""
    if shape.num_heads % tp:
        return f"TP {tp} does not divide the {shape.num_heads} attention heads"
    k = shape.num_kv_heads
    if shape.mla is None and k % tp and tp % k:
        return (f"TP {tp} and the {k} KV heads: neither divides the other, so the heads "
                "cannot be split or evenly replicated")
    if shape.num_dense_layers and shape.intermediate_size % tp:
        return f"TP {tp} does not divide intermediate_size {shape.intermediate_size}"
    if shape.moe is not None:
        if shape.moe.shared_intermediate % tp:
            return (f"TP {tp} does not divide the shared expert width "
                    f"{shape.moe.shared_intermediate}")
        if not expert_parallel and shape.moe.expert_intermediate % tp:
            return (f"TP {tp} does not divide moe_intermediate_size "
                    f"{shape.moe.expert_intermediate}")
    return ""


def _kv_share(shape: ModelShape, tp: int) -> float:
    """The fraction of a sequence's KV cache one of ``tp`` GPUs holds: its KV heads, one
    head when there are more GPUs than heads (the heads are replicated), everything for
    MLA (the latent is not split by head)."""
    if shape.mla is not None:
        return 1.0
    return 1.0 / min(tp, shape.num_kv_heads)


def plan_layout(shape: ModelShape, req: Request, layout: Layout) -> LayoutPlan:
    gpu = GPUS[req.gpu]
    expert_parallel = layout.ep > 1
    out = LayoutPlan(layout=layout, valid=True)
    problem = tp_problem(shape, layout.tp, expert_parallel)
    if not problem and expert_parallel:
        if shape.moe is None:
            problem = "expert parallelism needs a mixture-of-experts model"
        elif shape.moe.num_experts % layout.ep:
            problem = (f"EP {layout.ep} does not divide the {shape.moe.num_experts} experts")
    if problem:
        out.valid, out.reason = False, problem
        return out
    p = shape.params()
    q = WEIGHT_BYTES[req.dtype]
    tp = layout.tp
    # Split by TP: the linear layers, embeddings and lm_head (vocab-parallel); replicated
    # on every GPU: norms and routers. Experts: split by TP, or whole experts over EP.
    dense_quant = p.attention + p.dense_mlp + p.shared_experts
    weights = (dense_quant * q + (p.embedding + p.lm_head) * 2) / tp + (p.norms + p.router) * 2
    expert_bytes = p.experts * q
    weights += expert_bytes / (layout.ep if expert_parallel else tp)
    seqs = math.ceil(req.concurrency / layout.dp)
    kv = seqs * kv_bytes_per_sequence(shape, req.context, req.kv_dtype) * _kv_share(shape, tp)
    # Activations are counted whole on each GPU (TP splits part of them): a safe side.
    act = prefill_activation_bytes(shape, min(req.prefill_chunk, req.context)) \
        + logits_bytes(shape, seqs)
    out.weights_per_gpu, out.kv_per_gpu = round(weights), round(kv)
    out.activations_per_gpu = act
    out.usable_per_gpu = int(gpu.memory_bytes * (1 - req.headroom))
    out.fits = out.total_per_gpu <= out.usable_per_gpu
    if shape.mla is None and tp > shape.num_kv_heads:
        out.notes.append(f"{shape.num_kv_heads} KV heads over TP {tp}: each head's cache is "
                         f"held by {tp // shape.num_kv_heads} GPUs")

    # One decode step: every GPU reads its dense weights (bar the embedding table, of which
    # a step reads a row per sequence), the experts its tokens reach, and its KV cache.
    read = weights - p.embedding * 2 / tp - expert_bytes / (layout.ep if expert_parallel
                                                             else tp)
    if shape.moe is not None and shape.num_moe_layers:
        m = shape.moe
        one_expert = shape.expert_params() * q * shape.num_moe_layers
        if expert_parallel:  # every sequence's tokens meet the experts, spread over EP GPUs
            touched = expected_experts_touched(m.num_experts, m.experts_per_token,
                                               req.concurrency)
            read += touched * one_expert / layout.ep
        else:
            touched = expected_experts_touched(m.num_experts, m.experts_per_token, seqs)
            read += touched * one_expert / tp
    read += kv
    out.decode_bytes_per_step = round(read)
    step_s = read / gpu.bandwidth_bytes_s
    out.decode_tokens_s_per_seq = 1 / step_s
    out.decode_tokens_s = req.concurrency / step_s
    return out


def candidate_layouts(shape: ModelShape, max_gpus: int) -> list[tuple[int, bool]]:
    """(tp, expert parallel?) pairs worth trying: every TP size, with and without EP for
    MoE models."""
    eps = (False, True) if shape.moe is not None else (False,)
    return [(tp, ep) for tp in TP_SIZES if tp <= max_gpus for ep in eps]


def smallest_fit(shape: ModelShape, req: Request, tp: int, expert_parallel: bool
                 ) -> LayoutPlan:
    """The fewest data-parallel groups of ``tp`` GPUs that hold the load (more groups
    split the sequences, and with EP the experts, further); the largest tried when none
    fits within ``max_gpus``. With EP the GPU count must divide the experts (and be >= 2)."""
    problem = tp_problem(shape, tp, expert_parallel)
    if problem:
        return LayoutPlan(layout=Layout(tp=tp, dp=1, ep=tp if expert_parallel else 1),
                          valid=False, reason=problem)
    last: LayoutPlan | None = None
    for dp in range(1, req.max_gpus // tp + 1):
        n = tp * dp
        if expert_parallel and (n < 2 or shape.moe is None or shape.moe.num_experts % n):
            continue
        last = plan_layout(shape, req, Layout(tp=tp, dp=dp, ep=n if expert_parallel else 1))
        if last.fits:
            return last
        # Without EP, more groups only help while each still has more than one sequence.
        if not expert_parallel and math.ceil(req.concurrency / dp) == 1:
            break
    if last is None:
        experts = shape.moe.num_experts if shape.moe else 0
        return LayoutPlan(layout=Layout(tp=tp, dp=1, ep=tp), valid=False,
                          reason=f"no GPU count from {max(tp, 2)} to {req.max_gpus} in "
                                 f"steps of TP {tp} divides the {experts} experts")
    weights_alone = last.weights_per_gpu + last.activations_per_gpu > last.usable_per_gpu
    last.notes.append(
        f"the most GPUs tried ({last.layout.gpus}) still fall short: "
        + ("the weights alone exceed a GPU" if weights_alone else "too little room for the KV "
           "cache"))
    return last


@dataclass
class Plan:
    shape: ModelShape
    request: Request
    gpu: Gpu
    layouts: list[LayoutPlan]
    recommended: LayoutPlan | None
    warnings: list[str]

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the API's response body)."""
        s, r = self.shape, self.request
        p = s.params()
        moe = None
        if s.moe is not None:
            moe = {"num_experts": s.moe.num_experts,
                   "experts_per_token": s.moe.experts_per_token,
                   "expert_intermediate_size": s.moe.expert_intermediate,
                   "shared_expert_intermediate_size": s.moe.shared_intermediate,
                   "moe_layers": s.num_moe_layers, "params_per_expert": s.expert_params()}
        chunk = min(r.prefill_chunk, r.context)
        kv_seq = kv_bytes_per_sequence(s, r.context, r.kv_dtype)
        return {
            "model": {
                "model_type": s.model_type, "hidden_size": s.hidden_size,
                "num_layers": s.num_layers, "num_attention_heads": s.num_heads,
                "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
                "vocab_size": s.vocab_size, "attention": "mla" if s.mla else "gqa",
                "sliding_window_layers": sum(w is not None for w in s.windows),
                "moe": moe, "params_total": p.total, "params_active": s.active_params(),
                "params_by_kind": {
                    "embedding": p.embedding, "lm_head": p.lm_head,
                    "attention": p.attention, "dense_mlp": p.dense_mlp,
                    "experts": p.experts, "shared_experts": p.shared_experts,
                    "router": p.router, "norms": p.norms},
            },
            "request": {"concurrency": r.concurrency, "context": r.context, "gpu": r.gpu,
                        "dtype": r.dtype, "kv_dtype": r.kv_dtype, "headroom": r.headroom,
                        "prefill_chunk": chunk, "max_gpus": r.max_gpus},
            "gpu": {"key": self.gpu.key, "name": self.gpu.name,
                    "memory_bytes": self.gpu.memory_bytes,
                    "bandwidth_bytes_s": self.gpu.bandwidth_bytes_s},
            "memory": {
                "weights_by_dtype": {d: weight_bytes(s, d) for d in WEIGHT_BYTES},
                "weights": weight_bytes(s, r.dtype),
                "kv_per_token": kv_bytes_per_token(s, r.kv_dtype),
                "kv_per_sequence": kv_seq,
                "kv_total": kv_seq * r.concurrency,
                "prefill_activations": prefill_activation_bytes(s, chunk),
                "logits": logits_bytes(s, r.concurrency),
            },
            "decode": {
                "weight_bytes_per_token": decode_weight_bytes_per_token(s, r.dtype),
                "kv_bytes_per_token": kv_seq,
                "bytes_per_token": decode_weight_bytes_per_token(s, r.dtype) + kv_seq,
            },
            "layouts": [_layout_dict(lp) for lp in self.layouts],
            "recommended": _layout_dict(self.recommended) if self.recommended else None,
            "gpus_needed": self.recommended.layout.gpus if self.recommended else None,
            "warnings": self.warnings,
        }


def _layout_dict(lp: LayoutPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"tp": lp.layout.tp, "dp": lp.layout.dp, "ep": lp.layout.ep,
                           "gpus": lp.layout.gpus, "valid": lp.valid, "reason": lp.reason,
                           "fits": lp.fits, "notes": lp.notes}
    if lp.valid:
        out.update({"weights_per_gpu": lp.weights_per_gpu, "kv_per_gpu": lp.kv_per_gpu,
                    "activations_per_gpu": lp.activations_per_gpu,
                    "total_per_gpu": lp.total_per_gpu, "usable_per_gpu": lp.usable_per_gpu,
                    "decode_bytes_per_step": lp.decode_bytes_per_step,
                    "decode_tokens_s": round(lp.decode_tokens_s, 1),
                    "decode_tokens_s_per_sequence": round(lp.decode_tokens_s_per_seq, 2)})
    return out


def plan(shape: ModelShape, req: Request) -> Plan:
    """Every TP size (with and without EP for MoE) at its fewest GPUs; the recommendation
    is the layout needing fewest GPUs, then the fastest decode."""
    layouts: list[LayoutPlan] = []
    for tp, ep in candidate_layouts(shape, req.max_gpus):
        found = smallest_fit(shape, req, tp, ep)
        # EP over one TP group holds and reads what TP alone does: show it once.
        if ep and found.valid and found.layout.dp == 1 and any(
                lp.layout == Layout(tp=tp, dp=1, ep=1) for lp in layouts):
            continue
        layouts.append(found)
    fitting = [lp for lp in layouts if lp.valid and lp.fits]
    best = min(fitting, key=lambda lp: (lp.layout.gpus, -lp.decode_tokens_s), default=None)
    warnings = []
    limit = shape.max_position_embeddings
    if limit is not None and req.context > limit:
        warnings.append(f"context {req.context} exceeds the model's max_position_embeddings "
                        f"{limit}: it needs RoPE scaling (e.g. YaRN) to be served that long")
    if best is None:
        warnings.append(f"no layout of up to {req.max_gpus} {req.gpu} GPUs holds this load; "
                        "lower the concurrency or context, quantise, or allow more GPUs")
    return Plan(shape=shape, request=req, gpu=GPUS[req.gpu], layouts=layouts,
                recommended=best, warnings=warnings)
