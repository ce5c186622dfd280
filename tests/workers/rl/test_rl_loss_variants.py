"""Sequence-level IS, GSPO, CISPO and DAPO's pieces against values computed by hand here.

The shared batch: 2 completions x 3 positions, the sampler gave every token p = 1/4, the
trained policy gives seq 0 the probabilities (1/2, 1/2, 1/4), ratios (2, 2, 1), and seq 1
(1/8, 1/4), ratios (1/2, 1), its third position padding (a ratio of 3 there must never count).
Advantages +1 and -1. So log p = (-ln2, -ln2, -2 ln2) and (-3 ln2, -2 ln2); sum of log p is
-4 ln2 and -5 ln2; 5 loss tokens in all.
"""

import math

import pytest
import torch

from workers.rl import advantages
from workers.rl import importance as imp
from workers.rl.losses import policy_loss
from workers.rl.spec import SpecError, parse_spec

LN2 = math.log(2.0)
MODES = ("clip", "tis", "cispo", "seq_tis", "seq_mis", "gspo")


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32),
                          torch.as_tensor(b, dtype=torch.float32), atol=tol)


def batch():
    rollout = torch.log(torch.full((2, 3), 0.25))
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.125, 0.25, 0.75]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, rollout, torch.tensor([1.0, -1.0]), mask


def run(importance, **kw):
    logp, rollout, adv, mask = batch()
    loss, st = policy_loss(logp, rollout, adv, mask, importance=importance, **kw)
    loss.backward()
    return loss, st, logp.grad


def test_sequence_log_ratio_sums_or_averages_the_loss_tokens():
    logp, rollout, _, mask = batch()
    lr = (logp - rollout).detach()
    assert close(imp.seq_log_ratio(lr, mask, "sum"), [2 * LN2, -LN2])
    assert close(imp.seq_log_ratio(lr, mask, "mean"), [2 * LN2 / 3, -LN2 / 2])
    # a sequence with no loss token has log-ratio 0 (weight 1) in both modes
    empty = torch.zeros(1, 3)
    assert close(imp.seq_log_ratio(torch.ones(1, 3), empty, "mean"), [0.0])
    with pytest.raises(ValueError, match="sum \\| mean"):
        imp.seq_log_ratio(lr, mask, "max")


def test_sequence_truncated_is_caps_the_whole_completions_weight():
    loss, st, grad = run("seq_tis", tis_cap=2.0)
    # weights exp(2 ln2) = 4 -> capped at 2, and exp(-ln2) = 0.5;
    # terms -w A log p: seq 0: -2 * (-4 ln2) = 8 ln2; seq 1: 0.5 * (-5 ln2) = -2.5 ln2
    assert close(loss, (8 * LN2 - 2.5 * LN2) / 5)
    # the weight is a constant: d/d log p = -w A / 5 on loss tokens, 0 on padding
    assert close(grad, [[-0.4, -0.4, -0.4], [0.1, 0.1, 0.0]])
    assert close(st["seq/ratio_mean"], (4 + 0.5) / 2) and close(st["seq/ratio_max"], 4.0)
    assert close(st["seq/ratio_min"], 0.5) and close(st["seq/clip_frac"], 0.5)
    assert close(st["clip_frac"], 3 / 5) and "seq/masked_frac" not in st


def test_sequence_truncated_is_with_the_length_normalised_weight():
    loss, st, _ = run("seq_tis", tis_cap=2.0, seq_log_ratio="mean")
    w0, w1 = 2 ** (2 / 3), 2 ** -0.5  # geometric means of (2, 2, 1) and (1/2, 1): under the cap
    assert close(loss, (w0 * 4 * LN2 - w1 * 5 * LN2) / 5)
    assert close(st["seq/clip_frac"], 0.0) and close(st["seq/ratio_max"], w0)


def test_sequence_masked_is_drops_completions_outside_the_band():
    loss, st, grad = run("seq_mis", seq_mask_low=0.5, seq_mask_high=2.0)
    # w = 4 is outside [0.5, 2]: seq 0 leaves the loss; seq 1 (w = 0.5, inside: bounds count)
    # keeps -0.5 * (-1) * log p over its 2 tokens, which are now all the tokens there are
    assert close(loss, 0.5 * (-5 * LN2) / 2)
    assert close(grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])
    assert close(st["seq/masked_frac"], 0.5) and close(st["kept_frac"], 2 / 6)
    assert close(st["clip_frac"], 3 / 5)


def test_sequence_masked_is_with_every_completion_masked_is_a_zero_loss():
    loss, st, grad = run("seq_mis", seq_mask_low=0.6, seq_mask_high=2.0)
    assert torch.isfinite(loss) and close(loss, 0.0) and close(grad, torch.zeros(2, 3))
    assert close(st["seq/masked_frac"], 1.0) and close(st["kept_frac"], 0.0)


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mis", "gspo"])
def test_a_far_off_policy_long_completion_stays_finite(mode):
    # 100 tokens at ratio e^2: the sequence log-ratio is 200, exp(200) overflows float32
    logp = torch.full((1, 100), -1.0, requires_grad=True)
    rollout = torch.full((1, 100), -3.0)
    loss, st = policy_loss(logp, rollout, torch.tensor([1.0]), torch.ones(1, 100),
                           importance=mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in st.values())
    assert close(st["seq/clip_frac"], 1.0)  # truncated, masked or clipped, as each mode does


def test_an_empty_sequence_counts_in_no_sequence_statistic():
    logp, rollout, adv, _ = batch()
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, st = policy_loss(logp, rollout, adv, mask, importance="seq_mis")
    # only seq 0 (w = 4, masked) is a sequence; seq 1 is not counted as kept or masked
    assert close(st["seq/masked_frac"], 1.0) and close(st["seq/ratio_mean"], 4.0)
    assert close(st["seq/ratio_min"], 4.0) and close(loss, 0.0)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    s0, s1 = 2 ** (2 / 3), 2 ** -0.5  # exp(mean log r): 1.5874 and 0.7071
    # a wide range leaves both unclipped: per sequence -s A, averaged over sequences
    loss, st, grad = run("gspo", gspo_clip_low=0.7, gspo_clip_high=0.7, agg="seq_mean")
    assert close(loss, (-s0 + s1) / 2)
    # d(-s A)/d log p_t = -A s / |y| per token, then 1/2 for the mean over sequences
    assert close(grad, [[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]])
    assert close(st["seq/ratio_mean"], (s0 + s1) / 2) and close(st["seq/clip_frac"], 0.0)
    # token_mean weighs each sequence by its length: (3 (-s0) + 2 s1) / 5
    loss_tok, _, _ = run("gspo", gspo_clip_low=0.7, gspo_clip_high=0.7)
    assert close(loss_tok, (-3 * s0 + 2 * s1) / 5)


def test_gspo_with_the_papers_clip_range_clips_both_and_passes_no_gradient():
    loss, st, grad = run("gspo", agg="seq_mean")  # 3e-4 / 4e-4
    # A=+1, s0 > 1.0004: -1.0004; A=-1, s1 < 0.9997: -min(-s1, -0.9997) = 0.9997
    assert close(loss, (-1.0004 + 0.9997) / 2, 1e-6)
    assert close(grad, torch.zeros(2, 3)) and close(st["seq/clip_frac"], 1.0)


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    loss, st, grad = run("cispo", clip_low=0.2, clip_high=0.28)
    # weights clip(r, 0.8, 1.28): (1.28, 1.28, 1) and (0.8, 1); terms -w A log p
    seq0 = 1.28 * LN2 * 2 + 1.0 * 2 * LN2
    seq1 = 0.8 * -3 * LN2 + 1.0 * -2 * LN2
    assert close(loss, (seq0 + seq1) / 5)
    assert close(grad, [[-0.256, -0.256, -0.2], [0.16, 0.2, 0.0]])
    assert close(st["clip_frac"], 3 / 5)
    # PPO's surrogate on the same batch: the clipped tokens pass no gradient at all
    _, _, ppo_grad = run("clip", clip_low=0.2, clip_high=0.28)
    assert close(ppo_grad, [[0.0, 0.0, -0.2], [0.0, 0.2, 0.0]])


@pytest.mark.parametrize("mode", MODES)
def test_equal_policies_give_ratio_one_and_the_plain_policy_gradient(mode):
    _, _, adv, mask = batch()
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.125, 0.25, 0.75]])).requires_grad_()
    loss, st = policy_loss(logp, logp.detach(), adv, mask, importance=mode)
    loss.backward()
    assert close(st["ratio_mean"], 1.0) and close(st["clip_frac"], 0.0)
    assert close(st["kept_frac"], 5 / 6)
    if mode.startswith("seq_") or mode == "gspo":
        assert close(st["seq/ratio_mean"], 1.0) and close(st["seq/clip_frac"], 0.0)
    # on policy every objective is REINFORCE: d/d log p = -A / (loss tokens)
    assert close(logp.grad, [[-0.2, -0.2, -0.2], [0.2, 0.2, 0.0]])


def test_zero_advantage_gives_zero_loss_and_gradient_in_every_mode():
    for mode in MODES:
        logp, rollout, _, mask = batch()
        loss, _ = policy_loss(logp, rollout, torch.zeros(2), mask, importance=mode)
        loss.backward()
        assert close(loss, 0.0) and close(logp.grad, torch.zeros(2, 3)), mode


def test_overlong_penalty_ramps_over_the_last_buffer_tokens():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # max 10, buffer 4: free up to 6 tokens, then (6 - L) / 4, -1 at 10 and beyond
    assert close(advantages.overlong_penalty(lengths, 10, 4), [0, 0, -0.25, -0.5, -1, -1])
    assert close(advantages.overlong_penalty(lengths, 10, 4, factor=0.5),
                 [0, 0, -0.125, -0.25, -0.5, -0.5])
    assert close(advantages.overlong_penalty(lengths, 10, 0), torch.zeros(6))


def test_uniform_groups_are_exactly_the_zero_advantage_ones():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert advantages.uniform_groups(r).tolist() == [True, False, True]
    for name in ("grpo", "grpo_no_std", "dr_grpo", "rloo"):
        a = advantages.compute(name, r)
        assert (a.abs().sum(1) == 0).tolist() == [True, False, True], name


def test_spec_selects_the_variants_and_refuses_settings_of_another_mode():
    spec = parse_spec({"algorithm": {"importance": "seq_mis", "seq_mask_high": 3.0}})
    algo = spec.algorithm
    assert algo.mode_setting("seq_mask_high") == 3.0 and algo.mode_setting("seq_mask_low") == 0.5
    assert algo.mode_setting("seq_log_ratio") == "sum"
    # the frozen config names what was set and round-trips; unset mode settings are left out
    dumped = spec.model_dump(mode="json")["algorithm"]
    assert dumped["seq_mask_high"] == 3.0 and "seq_mask_low" not in dumped
    assert "gspo_clip_low" not in dumped and "overlong_penalty" not in dumped
    assert parse_spec(spec.model_dump(mode="json")) == spec
    with pytest.raises(SpecError, match="gspo_clip_low applies to importance = 'gspo', not "
                                        "'clip'"):
        parse_spec({"algorithm": {"gspo_clip_low": 0.001}})
    with pytest.raises(SpecError, match="seq_log_ratio applies to importance = 'seq_tis' or "
                                        "'seq_mis'"):
        parse_spec({"algorithm": {"importance": "gspo", "seq_log_ratio": "mean"}})
    with pytest.raises(SpecError, match="seq_mask_low must be < seq_mask_high"):
        parse_spec({"algorithm": {"importance": "seq_mis", "seq_mask_low": 2.0}})
    with pytest.raises(SpecError, match="overlong_penalty needs overlong_buffer > 0"):
        parse_spec({"algorithm": {"overlong_penalty": 0.5}})
    with pytest.raises(SpecError, match="overlong_buffer = 8 exceeds rollout.max_new_tokens"):
        parse_spec({"algorithm": {"overlong_buffer": 8}, "rollout": {"max_new_tokens": 6}})
    with pytest.raises(SpecError, match="importance"):
        parse_spec({"algorithm": {"importance": "ppo"}})
