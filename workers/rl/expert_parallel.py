"""Expert parallelism (EP) for transformers' Qwen3-MoE: experts sharded across ranks, tokens
moved to their experts and back with two all-to-alls per MoE layer.

transformers 5.24 stores a layer's experts as two stacked parameters,
`mlp.experts.gate_up_proj` (n, 2*I, H) and `mlp.experts.down_proj` (n, H, I), next to a router
`mlp.gate` (weight (n, H)). `shard_experts` keeps, on EP rank r of an EP group of size E, only
experts [r*n/E, (r+1)*n/E) of both stacks (same parameter names, a smaller first dimension) and
swaps the block's forward for one that:

1. routes the rank's own tokens with the replicated router (softmax, top-k, renormalised),
2. sends each (token, expert) pair's hidden state to the rank that owns the expert
   (`all_to_all_single`, per-expert counts exchanged first so every rank knows its splits),
3. runs its local experts on what it received and sends the results back (the reverse
   all-to-all),
4. multiplies by the routing weights and sums per token, as the unsharded block does.

The exchange is an autograd Function whose backward is the reverse all-to-all, so gradients
reach the expert shards from every rank's tokens and flow back to the router and attention.

Composition with data parallelism (`sync_gradients`): each rank has its own batch and the
training loss is the mean of the ranks' losses. Replicated parameters (embeddings, attention,
norms, router, head) are averaged over all ranks, as plain DDP does. An expert shard's local
gradient already sums the contributions of every rank of its EP group (their tokens came to it),
so expert gradients are summed over the ranks holding the same experts (one per EP group; none
when EP size == world size) and divided by the world size: both kinds then equal the gradient of
the unsharded model on the mean loss.

DeepSpeed (the trainer's path, `moe.expert_parallel`): `deepspeed_layout` builds the layout
on DeepSpeed's own expert / expert-data-parallel groups, the blocks are `deepspeed.moe.layer.MoE`
by type and their expert tensors carry DeepSpeed's marks (`allreduce = False`, `group_name`),
and the optimizer gets DeepSpeed's MoE parameter groups. DeepSpeed then does what
`sync_gradients` does by hand -- dense gradients averaged over all ranks, expert gradients
summed over the expert-data-parallel group and divided by the world size -- and ZeRO-1/2
partitions each expert group over its expert-data-parallel group. Its checkpoints write one
file per expert from the EP rank owning it (the blocks translate to its per-expert key layout);
`gathered_state_dict` gives the plain Hugging Face state dict for exports.

Works on gloo (CPU) and NCCL (GPU); on NCCL each rank must own its device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn


class ExpertParallelError(ValueError):
    """An expert-parallel layout that cannot be built; the message says which numbers clash."""


@dataclass(frozen=True)
class ExpertParallelLayout:
    """Where this rank sits: EP groups are consecutive ranks; the ranks holding the same
    experts (one per EP group, same EP rank) form its expert-data-parallel group."""

    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_group: Any = None  # dist.ProcessGroup; None when ep_size == 1
    expert_dp_group: Any = None  # dist.ProcessGroup; None when it would hold one rank
    dp_group: Any = None  # all ranks (None: the default group)

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size


def make_layout(ep_size: int) -> ExpertParallelLayout:
    """Create the process groups for EP size `ep_size` (collective: every rank must call it,
    in the same order). Without an initialised process group the world is one rank."""
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    rank = dist.get_rank() if initialised else 0
    if ep_size < 1 or world % ep_size:
        raise ExpertParallelError(
            f"expert-parallel size {ep_size} must divide the world size {world} "
            f"(ranks are split into world/ep groups of ep ranks each)"
        )
    ep_group = expert_dp_group = None
    if initialised:
        # new_group is collective over the whole world: create every group on every rank.
        for g in range(world // ep_size):
            ranks = list(range(g * ep_size, (g + 1) * ep_size))
            pg = dist.new_group(ranks) if ep_size > 1 else None
            if rank in ranks:
                ep_group = pg
        if world // ep_size > 1:
            for j in range(ep_size):
                ranks = list(range(j, world, ep_size))
                pg = dist.new_group(ranks)
                if rank in ranks:
                    expert_dp_group = pg
    return ExpertParallelLayout(world_size=world, rank=rank, ep_size=ep_size,
                                ep_rank=rank % ep_size, ep_group=ep_group,
                                expert_dp_group=expert_dp_group)


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """[first, end) of the experts EP rank `ep_rank` owns; equal shards only."""
    if num_experts % ep_size:
        raise ExpertParallelError(
            f"{num_experts} experts cannot be split evenly over expert-parallel size {ep_size}: "
            f"choose an EP size that divides the number of experts"
        )
    per = num_experts // ep_size
    return ep_rank * per, (ep_rank + 1) * per


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits along dim 0; the backward sends the gradients
    back the way the rows came (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = grads
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any) -> torch.Tensor:
    """Differentiable exchange: rows `in_splits[j]` of `x` go to rank j of `group`;
    `out_splits[j]` rows arrive from rank j."""
    out: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return out


DS_EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."  # DeepSpeed's per-expert keys
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-parallel / expert-data-parallel groups of size E."""
    return f"ep_size_{ep_size}"


class ExpertParallelMoeBlock(MoE):
    """Qwen3-MoE sparse block with this rank's experts only. Keeps the submodule names `gate`
    and `experts`, so parameter names (and checkpoints, once gathered) match the original.

    A `deepspeed.moe.layer.MoE` by type only (its __init__ is not run: the experts are
    transformers' stacked tensors, the dispatch is ours), because DeepSpeed enables its MoE
    handling -- expert gradients reduced over the expert-data-parallel group, ZeRO partitions
    per group, expert checkpoint files per EP rank -- only for models holding such a layer."""

    gate: nn.Module
    experts: Any  # transformers' experts module: stacked params, `act_fn`, `num_experts`

    def __init__(self, block: Any, layout: ExpertParallelLayout) -> None:
        nn.Module.__init__(self)
        gate, experts = block.gate, block.experts
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.first, self.end = expert_range(self.num_experts, layout.ep_size, layout.ep_rank)
        self.num_local = self.num_local_experts = self.end - self.first
        self.ep_size = layout.ep_size
        self.expert_group_name = group_name(layout.ep_size)
        self.group = layout.ep_group
        self.gate = gate  # replicated router
        self.experts = experts
        # The shards become the parameters; the rest of the stacks is freed.
        experts.gate_up_proj = nn.Parameter(
            experts.gate_up_proj.data[self.first:self.end].clone())  # (n/E, 2I, H)
        experts.down_proj = nn.Parameter(
            experts.down_proj.data[self.first:self.end].clone())  # (n/E, H, I)
        experts.num_experts = self.num_local
        for p in experts.parameters():  # DeepSpeed's expert-parameter marks (is_moe_param)
            p.allreduce = False
            p.group_name = self.expert_group_name
        self.register_state_dict_post_hook(_deepspeed_expert_layout)
        self._register_load_state_dict_pre_hook(_stack_deepspeed_experts)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed calls this on every MoE layer; `deepspeed_layout` made the groups."""

    def _exchange(self, x: torch.Tensor, out_splits: list[int],
                  in_splits: list[int]) -> torch.Tensor:
        return x if self.ep_size == 1 else all_to_all(x, out_splits, in_splits, self.group)

    def _run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` (SwiGLU) on rows x (m, H) -> (m, H), as transformers' eager loop."""
        gate, up = F.linear(x, self.experts.gate_up_proj[e]).chunk(2, dim=-1)  # (m, I) each
        return F.linear(self.experts.act_fn(gate) * up, self.experts.down_proj[e])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)  # (T, H) this rank's tokens
        _, weights, selected = self.gate(x)  # (T, k) routing weights, (T, k) global expert ids
        k = selected.shape[1]
        flat = selected.reshape(-1)  # (T*k,) one row per (token, choice)
        # Grouped by expert id, hence by owner rank: the send buffer is in that order.
        order = torch.argsort(flat, stable=True)  # (T*k,)
        token = order // k  # (T*k,) the token each sorted row belongs to
        send_per_expert = torch.bincount(flat, minlength=self.num_experts)  # (n,)
        if self.ep_size == 1:
            recv_per_expert = send_per_expert
        else:
            # Chunk j of n/E counts goes to rank j: each rank learns how many rows of each of
            # its experts every rank will send.
            recv_per_expert = torch.empty_like(send_per_expert)
            dist.all_to_all_single(recv_per_expert, send_per_expert, group=self.group)
        recv_counts = recv_per_expert.view(self.ep_size, self.num_local)  # (source rank, expert)
        send_splits = send_per_expert.view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        received = self._exchange(x[token], recv_splits, send_splits)  # (R, H)
        # Arrived grouped by source rank, then local expert: regroup by local expert.
        local_id = torch.repeat_interleave(
            torch.arange(self.num_local, device=x.device).repeat(self.ep_size),
            recv_counts.reshape(-1))  # (R,)
        perm = torch.argsort(local_id, stable=True)  # (R,)
        chunks = received[perm].split(recv_counts.sum(0).tolist())
        # Every local expert runs, even on zero rows, so its gradient is defined (zeros).
        y = torch.cat([self._run_expert(e, c) for e, c in enumerate(chunks)])  # (R, H)
        y = y[torch.argsort(perm)]  # back to arrival order

        returned = self._exchange(y, send_splits, recv_splits)  # (T*k, H) in `order`
        w = weights.reshape(-1)[order].unsqueeze(-1)  # (T*k, 1)
        out = torch.zeros_like(x).index_add(0, token, (returned * w).to(x.dtype))  # (T, H)
        return out.reshape(b, s, h)


def _deepspeed_expert_layout(module: nn.Module, state: dict[str, Any], prefix: str,
                             local_metadata: Any) -> None:
    """A block's own state dict (prefix '': only DeepSpeed's MoE checkpoint asks a layer
    directly, a model's state dict reaches it with a prefix) in DeepSpeed's per-expert layout
    `deepspeed_moe.experts.deepspeed_experts.<local id>.<tensor>`, so DeepSpeed writes one file
    per expert, by the EP rank that owns it, and maps local to global ids itself."""
    if prefix:
        return
    for name in EXPERT_TENSORS:
        stacked = state.pop(f"experts.{name}")
        for i in range(stacked.shape[0]):
            state[f"{DS_EXPERT_PREFIX}{i}.{name}"] = stacked[i]


def _stack_deepspeed_experts(state: dict[str, Any], prefix: str, *args: Any) -> None:
    """The reverse on load: DeepSpeed hands the per-expert tensors it read back under the
    layer's prefix; stack them into `experts.<tensor>` (local order)."""
    for name in EXPERT_TENSORS:
        keys = sorted((k for k in state if k.startswith(prefix + DS_EXPERT_PREFIX)
                       and k.endswith("." + name)),
                      key=lambda k: int(k[len(prefix + DS_EXPERT_PREFIX):].split(".")[0]))
        if keys:
            state[f"{prefix}experts.{name}"] = torch.stack([state.pop(k) for k in keys])


def _moe_blocks(model: nn.Module) -> Iterator[tuple[nn.Module, str, Any]]:
    """(parent, attribute, block) for every unsharded sparse MoE block: a router `gate` next
    to stacked `experts.gate_up_proj` / `experts.down_proj`."""
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            experts = getattr(child, "experts", None)
            if (not isinstance(child, ExpertParallelMoeBlock) and hasattr(child, "gate")
                    and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
                    and isinstance(getattr(experts, "down_proj", None), torch.Tensor)):
                yield parent, attr, child


def shard_experts(model: nn.Module, layout: ExpertParallelLayout) -> list[str]:
    """Convert every MoE block of `model` in place so this rank holds only its experts.
    Every rank must start from the same full weights (same seed or checkpoint). Returns the
    converted blocks' module names. Raises before changing anything if the experts do not
    split evenly over the EP size."""
    blocks = list(_moe_blocks(model))
    if not blocks:
        raise ExpertParallelError("the model has no sparse MoE blocks to shard")
    for _, _, block in blocks:
        expert_range(int(block.experts.gate_up_proj.shape[0]), layout.ep_size, layout.ep_rank)
    names = {id(m): n for n, m in model.named_modules()}
    converted = [names[id(block)] for _, _, block in blocks]
    for parent, attr, block in blocks:
        setattr(parent, attr, ExpertParallelMoeBlock(block, layout))
    return converted


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert shard; everything else is replicated."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for m in model.modules() if isinstance(m, ExpertParallelMoeBlock)
            for p in m.experts.parameters()]


def _all_reduce_flat(params: list[nn.Parameter], group: Any, scale: float,
                     reduce: bool) -> None:
    """Sum the grads over `group` in one flat buffer (one collective, not one per tensor),
    then scale. A missing grad counts as zeros so every rank sends the same layout."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if not reduce:
        for g in grads:
            g.mul_(scale)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(model: nn.Module, layout: ExpertParallelLayout) -> None:
    """After backward: make every gradient the gradient of the mean of the ranks' losses.
    Replicated: average over all ranks. Expert shards: sum over the ranks holding the same
    experts, divided by the world size (see the module docstring for why)."""
    expert = {id(p) for _, p in expert_parameters(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    scale = 1.0 / layout.world_size
    many = layout.world_size > 1
    _all_reduce_flat([p for p in trainable if id(p) not in expert], layout.dp_group, scale, many)
    _all_reduce_flat([p for p in trainable if id(p) in expert], layout.expert_dp_group, scale,
                     layout.expert_dp_size > 1)


def all_reduce_gradients(model: nn.Module, world_size: int, group: Any = None) -> None:
    """Plain data parallelism (every parameter replicated): average all grads over the ranks.
    The baseline EP is measured against, with the same flat-buffer collective."""
    params = [p for p in model.parameters() if p.requires_grad]
    _all_reduce_flat(params, group, 1.0 / world_size, world_size > 1)


def gather_experts(local: torch.Tensor, layout: ExpertParallelLayout) -> torch.Tensor:
    """Stack the EP group's shards of one expert tensor (or its grad) back to (n, ...)."""
    if layout.ep_size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(layout.ep_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=layout.ep_group)
    return torch.cat(parts)


def unsharded_state_dict(model: nn.Module, layout: ExpertParallelLayout) -> dict[str, torch.Tensor]:
    """The full model's state dict (collective over the EP group): expert shards gathered, so
    it loads into the unsharded model (`save_pretrained`, a checkpoint, the rollout engine)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in expert_parameters(model):
        state[name] = gather_experts(p, layout)
    return state


def deepspeed_layout(ep_size: int) -> ExpertParallelLayout:
    """This rank's layout on DeepSpeed's own expert / expert-data-parallel groups (created here
    when missing; collective), so the engine reduces expert gradients over the same groups the
    blocks dispatch on. DeepSpeed's layout equals `make_layout`'s: EP groups of consecutive
    ranks, expert-data-parallel groups strided by E."""
    from deepspeed.utils import groups

    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ExpertParallelError(
            f"moe.expert_parallel = {ep_size} must divide the world size {world} "
            f"(ranks are split into world/ep groups of ep ranks each)")
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    ep_group = groups._get_expert_parallel_group(name)
    edp_group = groups._get_expert_data_parallel_group(name)
    return ExpertParallelLayout(world_size=world, rank=rank, ep_size=ep_size,
                                ep_rank=dist.get_rank(group=ep_group), ep_group=ep_group,
                                expert_dp_group=edp_group if world > ep_size else None)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` holds expert-parallel blocks (its experts are spread over ranks)."""
    return any(isinstance(m, ExpertParallelMoeBlock) for m in model.modules())


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict, each block gathering its shards over its own EP
    group (collective over every rank of the world: all must call it)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for m in model.modules():
        if isinstance(m, ExpertParallelMoeBlock):
            for p in m.experts.parameters():
                if m.ep_size == 1:
                    continue
                parts = [torch.empty_like(p) for _ in range(m.ep_size)]
                dist.all_gather(parts, p.detach().contiguous(), group=m.group)
                state[names[id(p)]] = torch.cat(parts)
    return state


def expert_parameter_bytes(model: nn.Module) -> int:
    """Bytes of expert weights this rank holds (sharded or not)."""
    total = 0
    for _, _, block in _moe_blocks(model):
        total += sum(p.numel() * p.element_size() for p in block.experts.parameters())
    for _, p in expert_parameters(model):
        total += p.numel() * p.element_size()
    return total
