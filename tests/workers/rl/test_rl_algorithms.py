"""Advantage estimators, losses and MoE statistics against hand-computed values."""

import math

import pytest
import torch

from workers.rl import advantages
from workers.rl.engine import lr_factor
from workers.rl.losses import (
    aggregate,
    dpo_loss,
    entropy,
    expert_utilisation,
    kl_k3,
    load_balancing_loss,
    policy_loss,
    token_logprobs,
)

ln = math.log


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32),
                          torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_grpo_scales_by_unbiased_group_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = advantages.grpo(r)
    # mean 0.5, centred +-0.5, unbiased std sqrt(1/3): 0.5 / 0.57735 = 0.866025
    assert close(a[0], [0.866025, -0.866025, -0.866025, 0.866025], 1e-4)
    assert close(a[1], [0.0, 0.0, 0.0, 0.0])  # a solved group carries no signal


def test_grpo_without_std_and_dr_grpo_only_centre():
    r = torch.tensor([[3.0, 1.0]])
    assert close(advantages.grpo(r, scale_std=False), [[1.0, -1.0]])
    assert close(advantages.dr_grpo(r), [[1.0, -1.0]])
    assert close(advantages.compute("grpo_no_std", r), [[1.0, -1.0]])


def test_rloo_uses_leave_one_out_baseline():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # sample 0: baseline (0+0+1)/3 -> 1 - 1/3; sample 1: baseline 2/3 -> -2/3
    assert close(advantages.rloo(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages.compute("ppo", r)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, ln(3.0)]]])  # probs 0.25, 0.75
    assert close(token_logprobs(logits, torch.tensor([[1]])), [[ln(0.75)]])
    # temperature 2 halves the logits: p1 = sqrt(3) / (1 + sqrt(3))
    s3 = math.sqrt(3.0)
    assert close(token_logprobs(logits, torch.tensor([[1]]), 2.0), [[ln(s3 / (1 + s3))]])
    assert close(entropy(torch.zeros(1, 1, 4)), [[ln(4.0)]])


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert close(aggregate(v, m, "token_mean"), 10 / 4)
    assert close(aggregate(v, m, "seq_mean"), (2.0 + 4.0) / 2)
    assert close(aggregate(v, m, "seq_sum_norm", norm_len=3), 10 / 6)


def _ratios(r0: float, r1: float):
    rollout = torch.log(torch.tensor([[0.1, 0.1]]))
    logp = torch.log(torch.tensor([[0.1 * r0, 0.1 * r1]])).requires_grad_()
    return logp, rollout, torch.ones(1, 2)


def test_clipped_surrogate_positive_and_negative_advantage():
    logp, rollout, mask = _ratios(1.5, 0.5)
    loss, st = policy_loss(logp, rollout, torch.tensor([1.0]), mask, clip_low=0.2,
                           clip_high=0.2)
    # A=+1: -min(1.5, 1.2) = -1.2 and -min(0.5, 0.8) = -0.5 -> mean -0.85
    assert close(loss, -0.85)
    assert close(st["clip_frac"], 0.5) and close(st["ratio_mean"], 1.0)
    assert close(st["ratio_max"], 1.5) and close(st["ratio_min"], 0.5)
    loss.backward()
    # the clipped token gets no gradient; the other gets -A * r = -0.5 / 2 tokens
    assert close(logp.grad, [[0.0, -0.25]])
    loss_neg, st_neg = policy_loss(logp, rollout, torch.tensor([-1.0]), mask, clip_low=0.2,
                                   clip_high=0.2)
    # A=-1: -min(-1.5, -1.2) = 1.5 and -min(-0.5, -0.8) = 0.8 -> mean 1.15
    assert close(loss_neg, 1.15) and close(st_neg["clip_frac"], 0.5)


def test_clip_higher_is_asymmetric():
    logp, rollout, mask = _ratios(1.25, 1.0)
    loss, st = policy_loss(logp, rollout, torch.tensor([1.0]), mask, clip_low=0.2,
                           clip_high=0.28)
    assert close(loss, -(1.25 + 1.0) / 2) and close(st["clip_frac"], 0.0)


def test_truncated_importance_sampling():
    logp, rollout, mask = _ratios(3.0, 0.5)
    loss, st = policy_loss(logp, rollout, torch.tensor([1.0]), mask, importance="tis",
                           tis_cap=2.0)
    expected = -(2.0 * ln(0.3) + 0.5 * ln(0.05)) / 2  # weights min(r, 2), detached
    assert close(loss, expected) and close(st["clip_frac"], 0.5)
    loss.backward()
    assert close(logp.grad, [[-1.0, -0.25]])


def test_ratio_masking_drops_tokens():
    logp, rollout, mask = _ratios(1.5, 0.5)
    loss, st = policy_loss(logp, rollout, torch.tensor([1.0]), mask, mask_high=1.4)
    assert close(loss, -0.5) and close(st["kept_frac"], 0.5)
    loss, _ = policy_loss(logp, rollout, torch.tensor([1.0]), mask, mask_low=0.6)
    assert close(loss, -1.2)


def test_kl_k3():
    logp = torch.tensor([[ln(0.5), ln(0.3)]])
    ref = torch.tensor([[ln(0.25), ln(0.3)]])
    # d = ln(0.25/0.5) = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert close(kl_k3(logp, ref), [[0.5 + ln(2.0) - 1.0, 0.0]])


def test_dpo_loss():
    loss, acc = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
                         torch.tensor([-2.0]), beta=0.5)
    # margin (1) - (-1) = 2; -log sigmoid(0.5 * 2) = log(1 + e^-1)
    assert close(loss, ln(1 + math.exp(-1.0))) and close(acc, 1.0)


def test_load_balancing_loss_is_one_when_uniform_and_grows_when_collapsed():
    uniform = [torch.zeros(6, 4), torch.zeros(6, 4)]
    assert close(load_balancing_loss(uniform, top_k=2), 1.0)
    collapsed = [torch.tensor([[10.0, 10.0, -10.0, -10.0]]).repeat(6, 1)]
    # f = P = (0.5, 0.5, 0, 0): 4 * (0.25 + 0.25) = 2
    assert close(load_balancing_loss(collapsed, top_k=2), 2.0, 1e-4)
    # masked rows do not count
    mixed = [torch.cat([torch.zeros(2, 4), collapsed[0][:2]])]
    assert close(load_balancing_loss(mixed, 2, torch.tensor([1.0, 1.0, 0.0, 0.0])), 1.0)


def test_expert_utilisation_counts_and_entropy():
    spread = torch.eye(4) * 5  # token i routes to expert i
    util = expert_utilisation([spread, torch.tensor([[5.0, 0, 0, 0]]).repeat(4, 1)], top_k=1)
    assert util[0]["tokens"] == [1.0, 1.0, 1.0, 1.0] and abs(util[0]["load_entropy"] - 1) < 1e-6
    assert util[1]["tokens"] == [4.0, 0.0, 0.0, 0.0] and abs(util[1]["load_entropy"]) < 1e-6
    masked = expert_utilisation([spread], 1, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert masked[0]["tokens"] == [1.0, 1.0, 0.0, 0.0]


def test_lr_schedules():
    assert lr_factor(0, 10, 0, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(5, 10, 0, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 10, 0, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(5, 10, 0, "linear", 0.1) == pytest.approx(0.55)
    assert lr_factor(0, 10, 2, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(7, 10, 0, "constant", 0.0) == 1.0
