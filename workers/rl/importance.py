"""Policy-gradient objectives: how the ratio r = pi_theta / pi_rollout enters the loss.

Each function is pure and returns a `Terms`: the per-token loss to aggregate, the loss mask
(narrowed when a variant drops tokens or sequences), which tokens had their term clipped,
truncated or masked, and, for the sequence-level variants, each sequence's weight.
`losses.policy_loss` picks one by name, aggregates it and reports its statistics.

Shapes: B sequences, T completion positions. `log_ratio`, `logp`, `mask`: (B,T); `adv`: (B,1).
A sequence with no token in `mask` has log-ratio 0 (weight 1) and contributes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sequence weights are computed from log-ratios clamped here (exp(60) ~ 1e26): far above any
# cap or mask bound, so no loss changes, but a long off-policy completion's exp(sum) cannot
# overflow to inf (inf * a zero mask is NaN, and an infinite metric is not JSON).
LOG_WEIGHT_MAX = 60.0


@dataclass
class Terms:
    per_token: torch.Tensor  # (B,T) loss terms, aggregated by losses.aggregate
    mask: torch.Tensor  # (B,T) the tokens that count, after any dropping
    clipped: torch.Tensor  # (B,T) 1.0 where the token's term was clipped / truncated / dropped
    seq_weight: torch.Tensor | None = None  # (B,) the sequence-level ratio, detached
    seq_clipped: torch.Tensor | None = None  # (B,) 1.0 where the sequence was clipped / cut
    seq_masked: torch.Tensor | None = None  # (B,) 1.0 where the sequence was dropped


def seq_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One completion's log importance weight: sum_t log r_t (the exact sequence likelihood
    ratio) or its mean over the sequence's tokens (length-normalised, a geometric mean of the
    token ratios). (B,T) -> (B,)."""
    total = (log_ratio * mask).sum(-1)
    if mode == "sum":
        return total
    if mode == "mean":
        return total / mask.sum(-1).clamp(min=1.0)
    raise ValueError(f"unknown sequence log-ratio mode {mode!r} (sum | mean)")


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
             high: float) -> Terms:
    """PPO's pessimistic surrogate per token (Schulman et al. 2017):
    -min(r A, clip(r, 1-low, 1+high) A). Asymmetric bounds (high > low) are DAPO's
    clip-higher; a clipped token passes no gradient."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv
    return Terms(-torch.minimum(unclipped, clipped), mask, (clipped < unclipped).float())


def token_tis(ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              cap: float) -> Terms:
    """Truncated importance sampling per token: -sg[min(r, cap)] A log pi_theta. REINFORCE
    reweighted towards the trained policy, with the weight's variance bounded by `cap`."""
    weight = torch.clamp(ratio.detach(), max=cap)
    return Terms(-weight * adv * logp, mask, (ratio.detach() > cap).float())


def cispo(ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
          low: float, high: float) -> Terms:
    """CISPO (MiniMax-M1, 2025): -sg[clip(r, 1-low, 1+high)] A log pi_theta.

    The clip bounds the importance weight, not the update: unlike PPO's surrogate, where a
    clipped token passes no gradient, every token keeps its log pi gradient (rare tokens that
    fork a reasoning path are never dropped), scaled by at most 1+high."""
    r = ratio.detach()
    weight = torch.clamp(r, 1.0 - low, 1.0 + high)
    return Terms(-weight * adv * logp, mask, ((r < 1.0 - low) | (r > 1.0 + high)).float())


def seq_tis(log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor,
            mask: torch.Tensor, cap: float, mode: str) -> Terms:
    """Sequence-level truncated IS: w = exp(sum_t log r_t) (or the mean, `mode`), and every
    token of the completion gets -sg[min(w, cap)] A log pi_theta.

    One weight per completion corrects the off-policy-ness of the whole sample (the token-level
    product is what the sequence's probability ratio really is), and truncation bounds its
    variance, which grows with length (Ionides 2008; Yao et al. 2025 on sampler / trainer
    mismatch)."""
    w = torch.exp(seq_log_ratio(log_ratio.detach(), mask, mode).clamp(max=LOG_WEIGHT_MAX))  # (B,)
    cut = (w > cap).float()
    weight = torch.clamp(w, max=cap).unsqueeze(-1)  # (B,1)
    return Terms(-weight * adv * logp, mask, cut.unsqueeze(-1).expand_as(mask), w, cut)


def seq_mis(log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor,
            mask: torch.Tensor, low: float, high: float, mode: str) -> Terms:
    """Sequence-level masked IS: w = exp(sum_t log r_t) (or the mean, `mode`); a completion
    with w outside [low, high] is dropped from the loss, and the others get -sg[w] A log pi.

    Where truncation keeps a far-off-policy sample with a capped weight, masking rejects it
    (Liu et al. 2025, "When speed kills stability": seq-level MIS): a sample the sampler and
    the trainer disagree on that much is more likely an artefact than a signal."""
    w = torch.exp(seq_log_ratio(log_ratio.detach(), mask, mode).clamp(max=LOG_WEIGHT_MAX))  # (B,)
    valid = (mask.sum(-1) > 0).float()
    out = (((w < low) | (w > high)).float()) * valid
    kept = mask * (1.0 - out).unsqueeze(-1)
    per_token = -w.unsqueeze(-1) * adv * logp
    return Terms(per_token, kept, out.unsqueeze(-1).expand_as(mask), w, out, out)


def gspo(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
         high: float) -> Terms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the length-normalised
    sequence ratio s = exp(mean_t log r_t), clipped PPO-style per sequence:
    -min(s A, clip(s, 1-low, 1+high) A), every token of the completion carrying it.

    s keeps its gradient, which flows through the token log-probs as s * mean_t grad log pi;
    with `loss_agg = "seq_mean"` this is the paper's 1/G sum over sequences exactly (with
    `token_mean` each sequence weighs by its length). Its ratios stay near 1, so its clip range
    is small (the paper's 3e-4 / 4e-4); a clipped sequence passes no gradient."""
    s = torch.exp(seq_log_ratio(log_ratio, mask, "mean").clamp(max=LOG_WEIGHT_MAX))  # (B,)
    a = adv.squeeze(-1)
    unclipped = s * a
    clipped = torch.clamp(s, 1.0 - low, 1.0 + high) * a
    per_seq = -torch.minimum(unclipped, clipped)  # (B,)
    cut = (clipped < unclipped).float().detach()
    return Terms(per_seq.unsqueeze(-1).expand_as(mask), mask, cut.unsqueeze(-1).expand_as(mask),
                 s.detach(), cut)
