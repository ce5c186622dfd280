"""Train/infer mismatch and router replay (R3) for mixture-of-experts policies: pure maths.

The sampler (rollout backend) and the trainer compute the same policy with different kernels,
precisions and batch layouts, so their token log-probabilities differ and, on an MoE, their
routers can pick different experts for the same token (near-tied router logits flip). These
functions measure both, and the pieces router replay needs: force the sampler's recorded
expert indices while the weights still come from the trainer's own router logits, and check
that the forced routes landed on the right layers and tokens.

Routes are int tensors (..., L, k): per token, per MoE layer, the indices of its top-k experts;
`NO_ROUTE` (-1) marks a token with no record (padding, or a token the sampler never fed through
the model: the last sampled one of each generate call). Shapes: B rows, C completion positions,
L layers, k experts per token, N tokens, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NO_ROUTE = -1
ROUTE_DTYPE = torch.int16  # expert ids < 32768, as vLLM returns them; 1/4 of int64's memory


class ReplayBindingError(RuntimeError):
    """Under router replay the trainer's forward used routes other than the sampler's."""


def kl_k3(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || trainer) on tokens drawn from the sampler:
    r - 1 - log r with r = pi_trainer / pi_sampler. Non-negative; unbiased for that KL because
    the tokens are the sampler's own samples. Computed as expm1(d) - d in float64: near 0
    it is d^2/2, which exp(d) - 1 - d in float32 would bury under rounding. (B,C) -> (B,C)."""
    log_r = trainer_logp.double() - sampler_logp.double()
    return torch.expm1(log_r) - log_r


def max_ratio(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
              mask: torch.Tensor) -> float:
    """max over masked tokens of max(r, 1/r) = exp(|log pi_trainer - log pi_sampler|): the
    worst token's disagreement in either direction (1.0 = identical; 1.0 when no token)."""
    gap = (trainer_logp.float() - sampler_logp.float()).abs()
    gap = torch.where(mask.bool(), gap, torch.zeros_like(gap))
    return float(torch.exp(gap.max())) if gap.numel() else 1.0


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two routes pick the same expert SET (order within the k slots ignored):
    (..., L, k) x2 -> (..., L) bool."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def routed(routes: torch.Tensor) -> torch.Tensor:
    """(..., L, k) -> (...) bool: tokens that carry a route (every layer recorded)."""
    return (routes >= 0).all(-1).all(-1)


def expert_agreement(sampler: torch.Tensor, trainer: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per layer, how many tokens pick the same top-k expert set in sampler and trainer, over
    the tokens that `mask` keeps and both sides recorded; and how many tokens that is.
    sampler/trainer (B,C,L,k), mask (B,C). Returns ((L,) int64 counts, token count)."""
    keep = mask.bool() & routed(sampler) & routed(trainer)  # (B,C)
    agree = same_sets(sampler, trainer)[keep]  # (N,L)
    return agree.long().sum(0), int(keep.sum())


def force_routes(logits: torch.Tensor, own: torch.Tensor, forced: torch.Tensor | None,
                 norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing with the expert choice taken from `forced` where a token has one.

    logits (N,E): this forward's router logits; own (N,k): its own top-k; forced (N,k) or None,
    NO_ROUTE rows keep `own`. The weights are the router's softmax at the chosen experts,
    renormalised over them when `norm_topk` (= a softmax over the chosen experts' logits), so
    the loss still differentiates through the router logits (R3); with forced == own this is
    the block's own maths op for op. Returns (weights (N,k) in the logits' dtype, indices)."""
    idx = own
    if forced is not None:
        f = forced.to(own.device, torch.long)
        idx = torch.where((f >= 0).all(-1, keepdim=True), f, own)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(-1, idx)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), idx


def check_replayed(recorded: torch.Tensor, used: torch.Tensor, where: str = "") -> None:
    """Raise `ReplayBindingError` unless, on every token the sampler recorded, the trainer's
    forward used exactly the recorded expert set in every layer: agreement 1.0 per layer.
    recorded/used (B,T,L,k), `used` in the order the forward's layers actually ran. The
    message names the first failing layer, its agreement and a token (NeMo-RL #4057 replayed
    onto the wrong layers and nothing noticed)."""
    keep = routed(recorded)  # (B,T)
    if not bool(keep.any()):
        return
    if used.shape != recorded.shape:
        raise ReplayBindingError(f"router replay{where}: the trainer's forward routed "
                                 f"{tuple(used.shape)} (rows, tokens, layers, k) but the "
                                 f"sampler recorded {tuple(recorded.shape)}")
    agree = same_sets(recorded, used) | ~keep.unsqueeze(-1)  # (B,T,L)
    bad = (~agree).any(0).any(0)  # (L,)
    if not bool(bad.any()):
        return
    layer = int(bad.nonzero()[0])
    share = float(agree[..., layer][keep].float().mean())
    row, tok = (int(v) for v in (~agree[..., layer]).nonzero()[0])
    raise ReplayBindingError(
        f"router replay{where}: layer {layer} used other experts than the sampler recorded "
        f"(agreement {share:.4f}, must be 1.0; first at row {row}, token {tok}: recorded "
        f"{recorded[row, tok, layer].tolist()}, used {used[row, tok, layer].tolist()}): the "
        f"replayed routes are bound to the wrong layers or tokens")


def pad_routes(parts: list[torch.Tensor | None], left: bool) -> torch.Tensor | None:
    """Concatenate (b_i, T_i, L, k) routes along rows, padding positions with NO_ROUTE on the
    left (prompts) or the right (completions); None if any part has no routes."""
    if any(p is None for p in parts):
        return None
    ps = [p for p in parts if p is not None]
    width = max(p.shape[1] for p in ps)
    out = []
    for p in ps:
        fill = torch.full((p.shape[0], width - p.shape[1], *p.shape[2:]), NO_ROUTE,
                          dtype=p.dtype)
        out.append(torch.cat([fill, p] if left else [p, fill], 1))
    return torch.cat(out, 0)


@dataclass
class MismatchMeter:
    """Sums over one update's micro-batches of the sampler/trainer mismatch, reported as

    - `mismatch/kl`: mean over completion (loss-mask) tokens of `kl_k3`;
    - `mismatch/max_ratio`: max over those tokens of `max_ratio`'s max(r, 1/r);
    - `mismatch/expert_agreement/layer_<i>`: share of completion tokens (both sides routed)
      whose top-k expert set agrees between sampler and trainer, per MoE layer.

    Measured on the first update of a step only: later updates of the same batch run after an
    optimizer step, so their gap is policy change, not train/infer mismatch."""

    kl_sum: float = 0.0
    tokens: float = 0.0
    worst: float = 1.0
    agree: torch.Tensor | None = None  # (L,) summed counts
    routed_tokens: float = 0.0
    layers: int = 0  # MoE layers (0: no routes to compare), the same on every rank

    def add(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
            sampler_routes: torch.Tensor | None = None,
            trainer_routes: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            m = mask.float()
            self.kl_sum += float((kl_k3(trainer_logp, sampler_logp) * m).sum())
            self.tokens += float(m.sum())
            self.worst = max(self.worst, max_ratio(trainer_logp, sampler_logp, m))
            if sampler_routes is None or trainer_routes is None:
                return
            counts, n = expert_agreement(sampler_routes.to(trainer_routes.device),
                                         trainer_routes, mask)
            counts = counts.cpu()
            self.agree = counts if self.agree is None else self.agree + counts
            self.routed_tokens += n

    def result(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
               reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The metrics, summed (max-ed) over ranks by the given collectives: every rank calls
        this with the same layer count (a world of one passes identities)."""
        n_layers = self.layers
        agree = self.agree if self.agree is not None else torch.zeros(n_layers)
        if agree.shape[0] != n_layers:
            raise ValueError(f"routes of {agree.shape[0]} layers for a {n_layers}-layer model")
        local = torch.tensor([self.kl_sum, self.tokens, self.routed_tokens,
                              *agree.tolist()], dtype=torch.float64)
        tot = reduce_sum(local).tolist()
        worst = float(reduce_max(torch.tensor([self.worst], dtype=torch.float64))[0])
        out = {"mismatch/kl": tot[0] / max(tot[1], 1.0), "mismatch/max_ratio": worst}
        if n_layers and tot[2] > 0:
            for i in range(n_layers):
                out[f"mismatch/expert_agreement/layer_{i}"] = tot[3 + i] / tot[2]
        return out
