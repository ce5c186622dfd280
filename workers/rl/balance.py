"""Balanced experts for the Qwen3-MoE policy: load metrics, router z-loss, the global-batch
balance loss and auxiliary-loss-free balancing (a per-expert selection bias), as small pure
functions plus the hook that applies the bias to a transformers router.

Shapes: L MoE layers, N routed tokens, E experts, k experts per token. `w` is a per-token
weight (N,): 0/1 for padding, or how many rows a packed token stands for.

Why each piece (see docs/moe.md, "Balanced experts"):
- `maxvio` (DeepSeek-V3's MaxVio), `load_cv` and `routing_entropy` say how uneven a layer is;
- `z_loss` (ST-MoE) keeps router logits small, so routing stays numerically stable in bf16;
- `global_balance_loss`: the Switch loss with expert loads counted over the whole step (every
  micro-batch, every rank), so a micro-batch of one kind of prompt is not pushed to spread
  over every expert on its own (Qiu et al. 2025);
- `biased_topk` / `sign_update`: DeepSeek-V3's auxiliary-loss-free balancing: a bias b_i that
  only changes which experts are selected, nudged each step against the load, so balance
  costs no gradient that competes with the reward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workers.rl.routing import force_routes

BIAS = "balance_bias"  # the router buffer holding a layer's (E,) selection bias


def token_weights(n: int, mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """(N,) float weights: `mask` as given, or all ones."""
    if mask is None:
        return torch.ones(n, dtype=torch.float32, device=like.device)
    return mask.to(like.device, torch.float32).reshape(-1)


def maxvio(counts: torch.Tensor) -> torch.Tensor:
    """max_i load_i / mean_i load_i - 1 per layer (0 = perfectly even). (L,E) -> (L,)."""
    c = counts.double()
    mean = c.mean(-1)
    return torch.where(mean > 0, c.max(-1).values / mean.clamp(min=1e-12) - 1.0,
                       torch.zeros_like(mean))


def load_cv(counts: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation of expert loads per layer: population std / mean (0 = even).
    (L,E) -> (L,)."""
    c = counts.double()
    mean = c.mean(-1)
    std = c.std(-1, unbiased=False)
    return torch.where(mean > 0, std / mean.clamp(min=1e-12), torch.zeros_like(mean))


def routing_entropy(prob_sums: torch.Tensor) -> torch.Tensor:
    """Entropy of each layer's mean routing distribution (the router softmax averaged over
    tokens; sums are fine, they are normalised here) divided by log E: 1 = the router spreads
    its mass evenly on average, 0 = all on one expert. (L,E) -> (L,)."""
    p = prob_sums.double()
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
    ent = -(p * p.clamp(min=1e-300).log()).sum(-1)
    return ent / math.log(p.shape[-1])


def z_loss(router_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over (weighted) tokens of logsumexp(logits)^2,
    averaged over layers. router_logits (L,N,E) (or (N,E)); mask (N,)."""
    logits = router_logits if router_logits.dim() == 3 else router_logits.unsqueeze(0)
    z2 = torch.logsumexp(logits.float(), dim=-1).pow(2)  # (L,N)
    w = token_weights(z2.shape[1], mask, z2)
    return ((z2 * w).sum(-1) / w.sum().clamp(min=1e-12)).mean()


def select(probs: torch.Tensor, top_k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Top-k expert indices by probs + bias (selection only). probs (...,E), bias (E,) or
    broadcastable; returns (...,k)."""
    scores = probs if bias is None else probs + bias.to(probs.device, probs.dtype)
    return torch.topk(scores, top_k, dim=-1).indices


def biased_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing with the bias in the selection only: indices = top-k of
    softmax(logits) + bias, weights = the unbiased softmax at those indices (renormalised
    over them with `norm_topk`), so the bias never enters the forward value or its gradient.
    logits (N,E) -> (weights (N,k) in the logits' dtype, indices (N,k))."""
    probs = torch.softmax(logits.detach(), dim=-1, dtype=torch.float)
    idx = select(probs, top_k, bias)
    return force_routes(logits, idx, None, norm_topk)


def expert_counts(router_logits: torch.Tensor, top_k: int, mask: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """(L,E) weighted count of (token, slot) assignments per expert, selecting as the
    forward does (with the layer's bias, (L,E), when given). router_logits (L,N,E)."""
    probs = torch.softmax(router_logits.detach().float(), dim=-1)  # (L,N,E)
    idx = select(probs, top_k, None if bias is None else bias.unsqueeze(1))  # (L,N,k)
    w = token_weights(probs.shape[1], mask, probs)
    one = torch.zeros_like(probs).scatter_add_(-1, idx, w.view(1, -1, 1).expand(idx.shape))
    return one.sum(1)


def prob_sums(router_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(L,E) weighted sum over tokens of the router softmax: `routing_entropy`'s input."""
    probs = torch.softmax(router_logits.detach().float(), dim=-1)
    w = token_weights(probs.shape[1], mask, probs)
    return (probs * w.view(1, -1, 1)).sum(1)


def global_balance_loss(router_logits: torch.Tensor, global_counts: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch/GShard balance loss E * sum_e f_e * P_e averaged over layers, with f_e the
    share of the WHOLE step's assignments (all micro-batches, all ranks: `global_counts`
    (L,E), a constant) and P_e this micro-batch's mean router probability, which carries the
    gradient. Summed over micro-batches with weight 1/M it is E * sum f_e * mean P_e; on an
    unsplit batch it equals `losses.load_balancing_loss`. router_logits (L,N,E)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (L,N,E)
    w = token_weights(probs.shape[1], mask, probs)
    p_mean = (probs * w.view(1, -1, 1)).sum(1) / w.sum().clamp(min=1e-12)  # (L,E)
    c = global_counts.to(probs.device, torch.float32)
    frac = c / c.sum(-1, keepdim=True).clamp(min=1e-12)
    return (probs.shape[-1] * (frac * p_mean).sum(-1)).mean()


def sign_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's rule: b_i += rate * sign(mean load - load_i): an overloaded expert's
    bias falls, an underloaded one's rises, an exactly average one's stays. (L,E) both."""
    c = counts.to(bias.device, torch.float32)
    return bias + rate * torch.sign(c.mean(-1, keepdim=True) - c)


def layer_metrics(counts: torch.Tensor, psums: torch.Tensor) -> dict[str, float]:
    """The per-layer balance metrics of one step, from counts and prob sums (L,E) summed
    over its micro-batches and ranks."""
    out: dict[str, float] = {}
    for name, vals in (("maxvio", maxvio(counts)), ("load_cv", load_cv(counts)),
                       ("routing_entropy", routing_entropy(psums))):
        for i, v in enumerate(vals.tolist()):
            out[f"moe/{name}/layer_{i}"] = float(v)
    return out


# ---- the bias on a transformers model ------------------------------------------------------


def bias_hook(module: torch.nn.Module, args: tuple[Any, ...],
              out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
    """Forward hook on a `Qwen3MoeTopKRouter`: re-select its experts with its bias, weights
    from its own logits. The lean forward applies the same bias itself (lean_safe)."""
    logits = out[0]
    top_k: int = module.top_k  # type: ignore[assignment]
    weights, idx = biased_topk(logits, getattr(module, BIAS), top_k,
                               bool(getattr(module, "norm_topk_prob", True)))
    return logits, weights, idx


bias_hook.lean_safe = True  # type: ignore[attr-defined]


def attach(routers: list[torch.nn.Module]) -> None:
    """Give every router a zero (E,) selection bias -- a persistent buffer, so it travels in
    the module's state dict: DeepSpeed checkpoints, weight snapshots for the async actor --
    and the hook that applies it. The rollout backend samples from this same module (or a
    snapshot of it), so sampler and trainer select with the same bias."""
    for r in routers:
        if hasattr(r, BIAS):
            continue
        weight: torch.Tensor = getattr(r, "weight")  # noqa: B009 (typed: nn.Module attr)
        r.register_buffer(BIAS, torch.zeros(weight.shape[0], dtype=torch.float32,
                                            device=weight.device), persistent=True)
        r.register_forward_hook(bias_hook)


def biases(routers: list[torch.nn.Module]) -> torch.Tensor | None:
    """(L,E) the routers' current biases, or None when they carry none."""
    if not routers or not hasattr(routers[0], BIAS):
        return None
    return torch.stack([getattr(r, BIAS).detach().float().cpu() for r in routers])


@torch.no_grad()
def update_biases(routers: list[torch.nn.Module], counts: torch.Tensor, rate: float) -> None:
    """Apply `sign_update` to every router's bias in place from the step's (L,E) loads."""
    for r, row in zip(routers, counts, strict=True):
        b = getattr(r, BIAS)
        b.copy_(sign_update(b.unsqueeze(0), row.unsqueeze(0), rate)[0].to(b.device))
