"""4-bit gradient compression with error feedback, on plain torch.distributed (gloo or NCCL).

Why our own: DeepSpeed's ZeRO++ quantised gradients are GPU-only (they fail on the CPU backend),
and torch's stock DDP hooks stop at fp16 / PowerSGD. This module is the path that runs on both.

The wire format is per-block symmetric 4-bit: a block of ``block`` consecutive elements shares one
scale ``absmax / 7`` (stored in bf16 or fp16); each element becomes a code in -7..7, stored as
``code + 8`` in a nibble, two per byte (even element in the low nibble). With block 64 and a
16-bit scale that is 0.5 + 2/64 = 0.53 bytes per element against 4 (fp32) or 2 (bf16).

The all-reduce is a reduce-scatter then an all-gather, both on 4-bit bytes:
  1. every rank adds its error-feedback residual, quantises its whole (padded) gradient and sends
     chunk j to rank j (``all_to_all_single``);
  2. rank j dequantises the W chunks it owns and sums them, adds its own "server" residual,
     re-quantises that reduced chunk;
  3. ``all_gather`` of the reduced 4-bit chunks; every rank dequantises the same bytes, so every
     replica ends with bit-identical gradients.
What each quantisation lost is kept (per rank, per bucket) and added to the next step's input, so
the sum of what was communicated over steps tracks the sum of the true gradients within one
step's quantisation error instead of drifting.

Hierarchical mode (ranks spanning nodes): reduce in full precision inside a node to a leader,
run the compressed exchange among the leaders only, then broadcast the leader's 4-bit result
inside the node (each rank dequantises it). Only the leaders' exchange crosses nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

LEVELS = 7  # symmetric codes -7..7; the nibble value 0 (code -8) is never produced
DEFAULT_BLOCK = 64


# ---------------------------------------------------------------------------------------------
# Pure quantisation maths
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantized:
    """A flat tensor in 4-bit form: ``codes`` [n_blocks * block / 2] uint8 (two nibbles each),
    ``scales`` [n_blocks] in a 16-bit float; ``numel`` is the unpadded length."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + (
            self.scales.numel() * self.scales.element_size()
        )


def padded_length(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def quantize(x: torch.Tensor, block: int = DEFAULT_BLOCK,
             scale_dtype: torch.dtype = torch.bfloat16) -> Quantized:
    """Per-block symmetric 4-bit quantisation of a flat tensor (padded with zeros to whole
    blocks). Codes are computed against the *stored* (rounded) scale, so dequantisation sees
    exactly the scale the codes were made with; the rounding is < 1% of a scale, so
    |x| / scale stays below 7.5 and the clamp never bites."""
    if block % 2:
        raise ValueError(f"block must be even (two codes per byte), got {block}")
    flat = x.detach().reshape(-1).float()
    numel = flat.numel()
    n = padded_length(max(numel, 1), block)
    if n != numel:
        flat = torch.cat([flat, flat.new_zeros(n - numel)])
    blocks = flat.view(-1, block)  # [n_blocks, block]
    scales = (blocks.abs().amax(dim=1) / LEVELS).to(scale_dtype)  # [n_blocks]
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(blocks / safe[:, None]).clamp_(-LEVELS, LEVELS)
    q = torch.where(s[:, None] > 0, q, torch.zeros_like(q))
    nib = (q + 8).to(torch.uint8).view(-1, 2)  # [n/2, 2]
    codes = nib[:, 0] | (nib[:, 1] << 4)  # [n/2]
    return Quantized(codes=codes, scales=scales, numel=numel, block=block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 values the codes stand for, unpadded: code * scale."""
    lo = (q.codes & 0x0F).to(torch.int16) - 8
    hi = (q.codes >> 4).to(torch.int16) - 8
    vals = torch.stack([lo, hi], dim=1).reshape(-1, q.block).float()  # [n_blocks, block]
    return (vals * q.scales.float()[:, None]).reshape(-1)[: q.numel]


def max_abs_error(x: torch.Tensor, block: int = DEFAULT_BLOCK,
                  scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The worst-case round-trip error per element: half a quantisation step of its block
    (plus float slack), i.e. the bound tests and users can rely on."""
    q = quantize(x, block, scale_dtype)
    per_block = q.scales.float() / 2
    return per_block.repeat_interleave(block)[: q.numel]


def to_wire(q: Quantized) -> torch.Tensor:
    """Codes then scales' raw bytes, as one uint8 buffer: what actually goes over the network."""
    return torch.cat([q.codes, q.scales.contiguous().view(torch.uint8)])


def from_wire(buf: torch.Tensor, numel: int, block: int, scale_dtype: torch.dtype) -> Quantized:
    n = padded_length(numel, block)
    codes = buf[: n // 2]
    scales = buf[n // 2:].contiguous().view(scale_dtype)
    return Quantized(codes=codes, scales=scales, numel=numel, block=block)


def wire_bytes(numel: int, block: int, scale_dtype: torch.dtype) -> int:
    n = padded_length(numel, block)
    return n // 2 + (n // block) * torch.tensor([], dtype=scale_dtype).element_size()


def uncompressed_all_reduce_bytes(numel: int, world: int, element_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring or reduce-scatter + all-gather)
    all-reduce at full precision: 2 (W-1)/W N bytes-per-element. The baseline we compare to."""
    return 0 if world <= 1 else int(2 * (world - 1) * numel * element_size / world)


# ---------------------------------------------------------------------------------------------
# Error feedback
# ---------------------------------------------------------------------------------------------


@dataclass
class ErrorFeedback:
    """Residuals per key (a DDP bucket, a tensor name): what quantisation lost at the last step,
    added to the next step's input. Per rank by construction (each process holds its own)."""

    residuals: dict[Any, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: Any, x: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(key)
        if r is None or r.shape != x.shape or r.device != x.device:
            # A new key, or DDP rebuilt its buckets (first iterations): start from zero.
            return x.float()
        return x.float() + r

    def store(self, key: Any, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[key] = (compensated - sent).detach()

    def quantize(self, key: Any, x: torch.Tensor, block: int,
                 scale_dtype: torch.dtype) -> tuple[Quantized, torch.Tensor]:
        """Quantise x + residual; keep the new residual; return the codes and their values."""
        c = self.compensate(key, x)
        q = quantize(c, block, scale_dtype)
        deq = dequantize(q)
        self.store(key, c, deq)
        return q, deq

    def total_abs(self) -> float:
        return float(sum(r.abs().sum().item() for r in self.residuals.values()))


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------


@dataclass
class ByteCounter:
    """Bytes this rank put on the wire, by link: ``inter`` (the compressed exchange, which is
    what crosses nodes) and ``intra`` (inside a node, hierarchical mode only). Self-sends are
    not counted."""

    inter: int = 0
    intra: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.inter = self.intra = self.calls = 0


@dataclass
class CompressConfig:
    block: int = DEFAULT_BLOCK
    scale_dtype: torch.dtype = torch.bfloat16
    error_feedback: bool = True


# torch 2.13 renamed all_gather_into_tensor (which now warns); keep working on either.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def compressed_all_reduce_sum(flat: torch.Tensor, *, key: Any = 0, group: Any = None,
                              cfg: CompressConfig | None = None,
                              worker_ef: ErrorFeedback | None = None,
                              server_ef: ErrorFeedback | None = None,
                              counter: ByteCounter | None = None) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Sum of ``flat`` over ``group`` through 4-bit reduce-scatter + all-gather.

    Returns (sum [numel] float32, the all-gathered wire buffer) — the buffer is what a
    hierarchical leader forwards inside its node. Every rank of the group gets identical values.
    """
    cfg = cfg or CompressConfig()
    world = _size(group)
    numel = flat.numel()
    chunk = padded_length(max(-(-numel // world), 1), cfg.block)  # elements per owner
    padded = torch.zeros(world * chunk, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat.reshape(-1).float()

    # 1. quantise the whole gradient (+ residual), chunk j for owner j
    if worker_ef is not None and cfg.error_feedback:
        c = worker_ef.compensate(key, padded)
        pieces = [quantize(c[j * chunk:(j + 1) * chunk], cfg.block, cfg.scale_dtype)
                  for j in range(world)]
        worker_ef.store(key, c, torch.cat([dequantize(p) for p in pieces]))
    else:
        pieces = [quantize(padded[j * chunk:(j + 1) * chunk], cfg.block, cfg.scale_dtype)
                  for j in range(world)]
    per = wire_bytes(chunk, cfg.block, cfg.scale_dtype)
    send = torch.cat([to_wire(p) for p in pieces])  # [world * per] uint8
    recv = torch.empty_like(send)
    if world > 1:
        dist.all_to_all_single(recv, send, group=group)
    else:
        recv.copy_(send)

    # 2. the owner sums the W quantised versions of its chunk and re-quantises the sum
    owned = torch.zeros(chunk, dtype=torch.float32, device=flat.device)
    for i in range(world):
        owned += dequantize(from_wire(recv[i * per:(i + 1) * per], chunk, cfg.block,
                                      cfg.scale_dtype))
    if server_ef is not None and cfg.error_feedback:
        reduced, _ = server_ef.quantize(key, owned, cfg.block, cfg.scale_dtype)
    else:
        reduced = quantize(owned, cfg.block, cfg.scale_dtype)

    # 3. all-gather the reduced 4-bit chunks; everyone dequantises the same bytes
    mine = to_wire(reduced)
    gathered = torch.empty(world * per, dtype=torch.uint8, device=flat.device)
    if world > 1:
        _all_gather_single(gathered, mine, group=group)
    else:
        gathered.copy_(mine)
    if counter is not None:
        counter.inter += 2 * (world - 1) * per
        counter.calls += 1
    return decode_gathered(gathered, numel, world, cfg), gathered


def decode_gathered(gathered: torch.Tensor, numel: int, world: int,
                    cfg: CompressConfig) -> torch.Tensor:
    chunk = padded_length(max(-(-numel // world), 1), cfg.block)
    per = wire_bytes(chunk, cfg.block, cfg.scale_dtype)
    parts = [dequantize(from_wire(gathered[j * per:(j + 1) * per], chunk, cfg.block,
                                  cfg.scale_dtype)) for j in range(world)]
    return torch.cat(parts)[:numel]


@dataclass
class NodePlan:
    """The groups of a hierarchical exchange, built from a node map (node id per global rank).
    ``new_group`` is collective: every rank builds every group, in the same order."""

    node_of: list[int]
    node_group: Any
    leader_group: Any
    leader: int  # global rank of this rank's node leader
    is_leader: bool
    n_nodes: int

    @classmethod
    def build(cls, node_of: Sequence[int]) -> NodePlan:
        node_of = list(node_of)
        world, me = dist.get_world_size(), dist.get_rank()
        if len(node_of) != world:
            raise ValueError(f"node map names {len(node_of)} ranks, the world has {world}")
        nodes = sorted(set(node_of))
        members = {n: [r for r in range(world) if node_of[r] == n] for n in nodes}
        leaders = [members[n][0] for n in nodes]
        mine = None
        for n in nodes:
            g = dist.new_group(members[n])
            if node_of[me] == n:
                mine = g
        leader_group = dist.new_group(leaders)
        leader = members[node_of[me]][0]
        return cls(node_of=node_of, node_group=mine, leader_group=leader_group, leader=leader,
                   is_leader=me == leader, n_nodes=len(nodes))


def hierarchical_all_reduce_sum(flat: torch.Tensor, plan: NodePlan, *, key: Any = 0,
                                cfg: CompressConfig | None = None,
                                worker_ef: ErrorFeedback | None = None,
                                server_ef: ErrorFeedback | None = None,
                                counter: ByteCounter | None = None,
                                intra_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum over the world: full-precision (or bf16) reduce inside each node to its leader, the
    4-bit exchange among leaders, then the leader broadcasts its 4-bit result in the node."""
    cfg = cfg or CompressConfig()
    numel = flat.numel()
    x = flat.reshape(-1).float()
    node_size = dist.get_world_size(plan.node_group)
    if node_size > 1:
        # Gather raw bytes so any dtype travels (gloo's reductions lack bf16 on some builds).
        payload = x.to(intra_dtype).contiguous().view(torch.uint8)
        if plan.is_leader:
            bufs = [torch.empty_like(payload) for _ in range(node_size)]
            dist.gather(payload, gather_list=bufs, dst=plan.leader, group=plan.node_group)
            x = torch.stack([b.view(intra_dtype).float() for b in bufs]).sum(0)
        else:
            dist.gather(payload, dst=plan.leader, group=plan.node_group)
            if counter is not None:
                counter.intra += payload.numel()
    n_leaders = plan.n_nodes
    chunk = padded_length(max(-(-numel // n_leaders), 1), cfg.block)
    per = wire_bytes(chunk, cfg.block, cfg.scale_dtype)
    if plan.is_leader:
        _, gathered = compressed_all_reduce_sum(x, key=key, group=plan.leader_group, cfg=cfg,
                                                worker_ef=worker_ef, server_ef=server_ef,
                                                counter=counter)
    else:
        gathered = torch.empty(n_leaders * per, dtype=torch.uint8, device=flat.device)
    if node_size > 1:
        dist.broadcast(gathered, src=plan.leader, group=plan.node_group)
        if plan.is_leader and counter is not None:
            counter.intra += (node_size - 1) * gathered.numel()
    return decode_gathered(gathered, numel, n_leaders, cfg)


# ---------------------------------------------------------------------------------------------
# DDP comm hook
# ---------------------------------------------------------------------------------------------


@dataclass
class HookState:
    """What the DDP hook keeps between steps: residuals per bucket and the byte counter.
    ``plan`` set means hierarchical mode."""

    cfg: CompressConfig = field(default_factory=CompressConfig)
    plan: NodePlan | None = None
    intra_dtype: torch.dtype = torch.float32
    worker_ef: ErrorFeedback = field(default_factory=ErrorFeedback)
    server_ef: ErrorFeedback = field(default_factory=ErrorFeedback)
    counter: ByteCounter = field(default_factory=ByteCounter)
    elements: int = 0  # gradient elements reduced since the last counter reset

    def reset_counts(self) -> None:
        self.counter.reset()
        self.elements = 0

    def all_reduce_sum(self, x: torch.Tensor, key: object) -> torch.Tensor:
        """The 4-bit sum of ``x`` over the world (flat or hierarchical, as configured), with
        the residuals kept under ``key``; counts its elements."""
        if self.plan is None:
            total, _ = compressed_all_reduce_sum(x, key=key, cfg=self.cfg,
                                                 worker_ef=self.worker_ef,
                                                 server_ef=self.server_ef, counter=self.counter)
        else:
            total = hierarchical_all_reduce_sum(x, self.plan, key=key, cfg=self.cfg,
                                                worker_ef=self.worker_ef,
                                                server_ef=self.server_ef, counter=self.counter,
                                                intra_dtype=self.intra_dtype)
        self.elements += x.numel()
        return total


def compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through the 4-bit path. The collectives run
    synchronously here (buckets become ready in the same order on every rank), and the hook
    hands DDP an already-completed future."""
    buf = bucket.buffer()
    world = dist.get_world_size()
    # a rebuilt bucket of another size starts fresh
    total = state.all_reduce_sum(buf, key=(bucket.index(), buf.numel()))
    buf.copy_((total / world).to(buf.dtype).reshape(buf.shape))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects; this module's are strings (future import).
compress_hook.__annotations__.update(bucket=dist.GradBucket,
                                     state=HookState,
                                     **{"return": torch.futures.Future[torch.Tensor]})


def register(ddp_model: torch.nn.parallel.DistributedDataParallel,
             state: HookState | None = None) -> HookState:
    """Make a DDP model communicate its gradients in 4 bits; returns the hook state (bytes,
    residuals)."""
    state = state or HookState()
    ddp_model.register_comm_hook(state, compress_hook)
    return state


# ---------------------------------------------------------------------------------------------
# Outside DDP: one flat compressed all-reduce of a list of gradients (DeepSpeed stage 0)
# ---------------------------------------------------------------------------------------------


def all_reduce_grads(params: Sequence[torch.nn.Parameter], state: HookState) -> None:
    """Average the ``.grad`` of ``params`` over the world in place, as one flat 4-bit
    exchange (one residual for the whole vector)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])  # [N]
    mean = state.all_reduce_sum(flat, key=("flat", flat.numel())) / dist.get_world_size()
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(mean[offset:offset + n].view_as(g))
        offset += n


def attach_to_deepspeed(engine: Any, state: HookState | None = None) -> HookState:
    """Replace a ZeRO stage-0 DeepSpeed engine's gradient all-reduce with the 4-bit one.

    At stage 0 DeepSpeed reduces every gradient in ``allreduce_gradients`` at the accumulation
    boundary and nowhere else; at stages 1-3 its optimizer owns the communication, so this
    refuses them (the spec refuses the combination first)."""
    if engine.zero_optimization_stage() != 0:
        raise ValueError("4-bit gradient compression replaces DeepSpeed's all-reduce only at "
                         f"ZeRO stage 0, not {engine.zero_optimization_stage()}")
    state = state or HookState()
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def allreduce_gradients(*_args: Any, **_kwargs: Any) -> None:
        if engine.is_gradient_accumulation_boundary():
            all_reduce_grads(params, state)

    engine.allreduce_gradients = allreduce_gradients
    engine.crucible_grad_compress = state
    return state
