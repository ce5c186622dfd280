"""Losses and per-token statistics as small pure functions.

Shapes: B sequences, T completion positions, V vocabulary, N routed tokens, E experts.
`mask` is 1.0 on completion tokens that count and 0.0 on prompt/padding positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from workers.rl import importance as imp


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log p(target) under softmax(logits / temperature). logits (B,T,V), targets (B,T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B,T)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy of the sampling distribution. (B,T,V) -> (B,T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int = 1):
    """Reduce per-token values (B,T) to a scalar.

    token_mean:   every token in the batch weighs the same (DAPO).
    seq_mean:     mean within each sequence, then over sequences (original GRPO).
    seq_sum_norm: sum over tokens / (B * norm_len), a constant length (Dr.GRPO); no length bias.
    """
    if mode == "token_mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "seq_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean()
    if mode == "seq_sum_norm":
        return (values * mask).sum() / (values.shape[0] * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance: str = "clip",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float = 2.0,
    mask_low: float | None = None,
    mask_high: float | None = None,
    agg: str = "token_mean",
    norm_len: int = 1,
    seq_log_ratio: str = "sum",
    seq_mask_low: float = 0.5,
    seq_mask_high: float = 2.0,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss with the token-level ratio r = pi_theta / pi_rollout, one of the
    objectives in `workers.rl.importance` (formulas and papers there):

    "clip" (PPO; clip_low/clip_high, asymmetric = DAPO's clip-higher), "tis" (token truncated
    IS, tis_cap), "cispo" (clipped IS weight, no token dropped; clip_low/clip_high),
    "seq_tis" / "seq_mis" (one weight per completion, exp of the `seq_log_ratio` sum or mean
    of log r: truncated at tis_cap / masked outside [seq_mask_low, seq_mask_high]), "gspo"
    (length-normalised sequence ratio, clipped at gspo_clip_low/gspo_clip_high).
    Token ratio masking drops tokens whose r falls outside [mask_low, mask_high] first.
    logp, rollout_logp, mask: (B,T); advantages: (B,). Stats: clip_frac (share of loss tokens
    whose term was clipped / truncated / dropped), ratio_*, kept_frac, and for the sequence
    variants seq/ratio_*, seq/clip_frac and (seq_mis) seq/masked_frac over non-empty sequences.
    """
    log_ratio = logp - rollout_logp
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)  # (B,1)
    if mask_low is not None or mask_high is not None:
        keep = torch.ones_like(mask)
        if mask_low is not None:
            keep = keep * (ratio.detach() >= mask_low)
        if mask_high is not None:
            keep = keep * (ratio.detach() <= mask_high)
        mask = mask * keep
    if importance == "clip":
        terms = imp.ppo_clip(ratio, adv, mask, clip_low, clip_high)
    elif importance == "tis":
        terms = imp.token_tis(ratio, logp, adv, mask, tis_cap)
    elif importance == "cispo":
        terms = imp.cispo(ratio, logp, adv, mask, clip_low, clip_high)
    elif importance == "seq_tis":
        terms = imp.seq_tis(log_ratio, logp, adv, mask, tis_cap, seq_log_ratio)
    elif importance == "seq_mis":
        terms = imp.seq_mis(log_ratio, logp, adv, mask, seq_mask_low, seq_mask_high,
                            seq_log_ratio)
    elif importance == "gspo":
        terms = imp.gspo(log_ratio, adv, mask, gspo_clip_low, gspo_clip_high)
    else:
        raise ValueError(f"unknown importance mode {importance!r}")
    loss = aggregate(terms.per_token, terms.mask, agg, norm_len)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(terms.clipped, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": (ratio * mask).max() if mask.any() else ratio.new_tensor(1.0),
            "ratio_min": torch.where(mask > 0, ratio, torch.inf).min()
            if mask.any()
            else ratio.new_tensor(1.0),
            "kept_frac": terms.mask.sum() / terms.mask.numel(),
        }
        if terms.seq_weight is not None:
            stats.update(seq_stats(terms, mask))
    return loss, stats


def seq_stats(terms: imp.Terms, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sequence-level variants' statistics over sequences with at least one loss token
    (an empty sequence has no ratio to speak of): the same keys whatever the batch holds."""
    assert terms.seq_weight is not None and terms.seq_clipped is not None
    w = terms.seq_weight
    valid = (mask.sum(-1) > 0).float()  # (B,)
    n = valid.sum().clamp(min=1.0)
    any_valid = bool(valid.any())
    out = {
        "seq/ratio_mean": (w * valid).sum() / n,
        "seq/ratio_max": torch.where(valid > 0, w, -torch.inf).max() if any_valid
        else w.new_tensor(1.0),
        "seq/ratio_min": torch.where(valid > 0, w, torch.inf).min() if any_valid
        else w.new_tensor(1.0),
        "seq/clip_frac": (terms.seq_clipped * valid).sum() / n,
    }
    if terms.seq_masked is not None:
        out["seq/masked_frac"] = (terms.seq_masked * valid).sum() / n
    return out


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(d) - d - 1 with d = ref - logp.
    Non-negative and unbiased under samples from pi. (B,T) -> (B,T)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023) on sequence log-probabilities (P,) of preference pairs:
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))). Returns (loss, pair accuracy)."""
    margin = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    loss = -F.logsigmoid(beta * margin).mean()
    return loss, (margin > 0).float().mean()


def stacked(router_logits: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Per-layer router logits as one (L,N,E) tensor: layers are reduced together, in a few
    tensor ops instead of a Python loop of them per layer."""
    if isinstance(router_logits, torch.Tensor):
        return router_logits if router_logits.dim() == 3 else router_logits.unsqueeze(0)
    return torch.stack(list(router_logits))


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss, E * sum_e f_e * P_e, computed per layer and averaged.

    f_e is the fraction of routed (token, slot) assignments that went to expert e and P_e the
    mean router probability of e. Perfectly uniform routing gives 1.0. router_logits: per layer
    (N,E) (or stacked (L,N,E)); mask: (N,) 1.0 for real tokens.
    """
    return router_statistics(router_logits, top_k, mask)[0]


def router_statistics(
    router_logits: Sequence[torch.Tensor] | torch.Tensor, top_k: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`load_balancing_loss` with the two sums it is made of: (aux loss, (L,E) weighted
    (token, slot) counts per expert, (L,E) weighted router-probability sums), the last two
    detached. The trainer's expert-load and balance metrics read exactly these sums
    (`balance.expert_counts` and `balance.prob_sums` without a selection bias compute the same
    values with the same operations), so one softmax and one top-k serve the loss and the
    metrics."""
    probs = torch.softmax(stacked(router_logits).float(), dim=-1)  # (L,N,E)
    n_exp = probs.shape[-1]
    chosen = probs.topk(top_k, dim=-1).indices  # (L,N,k)
    assign = torch.zeros_like(probs).scatter_add_(
        -1, chosen, torch.ones(chosen.shape, dtype=probs.dtype, device=probs.device)
    )  # (L,N,E): 1 where a slot picked the expert
    if mask is None:
        w = torch.ones(probs.shape[1], dtype=probs.dtype, device=probs.device)
    else:
        w = mask.to(probs.dtype)
    denom = w.sum().clamp(min=1.0)
    counts = (assign * w[:, None]).sum(1)  # (L,E), no gradient (assign and w have none)
    sums = (probs * w[:, None]).sum(1)  # (L,E)
    frac = counts / (denom * top_k)
    prob = sums / denom
    return (n_exp * (frac * prob).sum(-1)).mean(), counts, sums.detach()


@torch.no_grad()
def expert_utilisation(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> list[dict[str, object]]:
    """Per layer: tokens routed to each expert and the load entropy normalised to [0, 1]
    (1 = perfectly balanced, 0 = everything on one expert). `mask`: 0/1 per token, or token
    weights (how many rows a packed token stands for)."""
    logits = stacked(router_logits)  # (L,N,E)
    n_layers, n_exp = logits.shape[0], logits.shape[-1]
    chosen = logits.topk(top_k, dim=-1).indices  # (L,N,k)
    weights = None
    if mask is not None and mask.is_floating_point() and bool((mask > 1).any()):
        # Token weights (a packed token standing for several rows): weighted counts.
        weights = mask.view(1, -1, 1).expand(chosen.shape).reshape(-1)
    elif mask is not None:
        chosen = chosen[:, mask.bool()]
    offset = torch.arange(n_layers, device=chosen.device).view(-1, 1, 1) * n_exp
    counts = torch.bincount((chosen + offset).reshape(-1), weights=weights,
                            minlength=n_layers * n_exp)
    counts = counts.view(n_layers, n_exp).float().cpu()  # (L,E)
    p = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
    ent = -(p * torch.log(p.clamp(min=1e-12))).sum(-1) / torch.log(torch.tensor(float(n_exp)))
    return [{"tokens": c, "load_entropy": e}
            for c, e in zip(counts.tolist(), ent.tolist(), strict=True)]
