"""The mismatch and router-replay maths (workers/rl/routing.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from workers.rl.routing import (
    NO_ROUTE,
    MismatchMeter,
    ReplayBindingError,
    check_replayed,
    expert_agreement,
    force_routes,
    kl_k3,
    max_ratio,
    pad_routes,
    same_sets,
)


def logs(*ps: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in ps]], dtype=torch.float64)


def test_kl_k3_is_r_minus_one_minus_log_r():
    # trainer/sampler probabilities 0.5/0.25 (r = 2), 0.3/0.3 (r = 1), 0.2/0.4 (r = 1/2)
    got = kl_k3(logs(0.5, 0.3, 0.2), logs(0.25, 0.3, 0.4))
    want = [2 - 1 - math.log(2), 0.0, 0.5 - 1 + math.log(2)]  # 0.30685, 0, 0.19315
    assert got[0].tolist() == pytest.approx(want, abs=1e-12)


def test_max_ratio_takes_the_worse_direction_on_masked_tokens_only():
    trainer = logs(0.5, 0.1, 0.8, 0.9)
    sampler = logs(0.25, 0.4, 0.1, 0.9)  # r = 2, 1/4, 8, 1
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # the r = 8 token is padding
    assert max_ratio(trainer, sampler, mask) == pytest.approx(4.0, rel=1e-6)
    assert max_ratio(trainer, sampler, torch.zeros(1, 4)) == 1.0


def test_same_sets_ignores_slot_order():
    a = torch.tensor([[1, 3], [1, 3], [0, 2]])
    b = torch.tensor([[3, 1], [1, 2], [0, 2]])
    assert same_sets(a, b).tolist() == [True, False, True]


def test_expert_agreement_counts_masked_recorded_tokens_per_layer():
    # B=1, C=4, L=2, k=2
    sampler = torch.tensor([[[[0, 1], [2, 3]],
                             [[0, 1], [2, 3]],
                             [[4, 5], [6, 7]],
                             [[NO_ROUTE, NO_ROUTE], [NO_ROUTE, NO_ROUTE]]]])
    trainer = torch.tensor([[[[1, 0], [2, 3]],   # token 0: both layers agree (slot order)
                             [[0, 2], [3, 2]],   # token 1: layer 0 differs
                             [[0, 0], [0, 0]],   # token 2: differs, but masked out
                             [[0, 1], [2, 3]]]])  # token 3: the sampler has no record
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    counts, n = expert_agreement(sampler, trainer, mask)
    assert n == 2 and counts.tolist() == [1, 2]


def test_force_routes_weights_are_the_softmax_over_the_forced_experts():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 1.0], [1.0, 2.0, 3.0, 1.0]]))
    logits.requires_grad_(True)
    own = torch.tensor([[2, 1], [2, 1]])
    forced = torch.tensor([[0, 2], [NO_ROUTE, NO_ROUTE]])  # row 1 keeps its own routes
    w, idx = force_routes(logits, own, forced, norm_topk=True)
    assert idx.tolist() == [[0, 2], [2, 1]]
    # p = (1, 2, 3, 1) / 7: experts 0 and 2 renormalised 1:3; row 1 experts 2 and 1, 3:2.
    assert w.tolist() == [pytest.approx([0.25, 0.75]), pytest.approx([0.6, 0.4])]
    w[0, 1].backward()  # the router still gets a gradient (R3): d w / d logits
    grad = logits.grad
    assert grad is not None
    # w = e^{l2} / (e^{l0} + e^{l2}): dw/dl2 = w(1-w) = 3/16, dw/dl0 = -3/16, others 0
    assert grad[0].tolist() == pytest.approx([-3 / 16, 0.0, 3 / 16, 0.0], abs=1e-6)
    w_raw, _ = force_routes(logits.detach(), own, forced, norm_topk=False)
    assert w_raw[0].tolist() == pytest.approx([1 / 7, 3 / 7])


def test_check_replayed_names_the_layer_and_token_that_differ():
    rec = torch.tensor([[[[0, 1], [2, 3], [4, 5]],
                         [[1, 2], [3, 4], [5, 6]]]])  # (B=1, T=2, L=3, k=2)
    check_replayed(rec, rec.flip(-1))  # slot order does not matter
    used = rec.clone()
    used[0, 1, 2] = torch.tensor([0, 7])
    with pytest.raises(ReplayBindingError, match=r"layer 2 .*agreement 0\.5000.*row 0, token 1"):
        check_replayed(rec, used)
    with pytest.raises(ReplayBindingError, match="layer 0"):
        check_replayed(rec, rec.roll(1, dims=2))  # bound one layer off
    with pytest.raises(ReplayBindingError, match="layer 0"):
        check_replayed(rec, rec.roll(1, dims=1))  # bound one token off
    with pytest.raises(ReplayBindingError, match="routed"):
        check_replayed(rec, rec[:, :1])
    # unrecorded tokens are not checked
    rec2 = rec.clone()
    rec2[0, 1] = NO_ROUTE
    check_replayed(rec2, used)


def test_pad_routes_pads_prompts_left_and_completions_right():
    a = torch.zeros((1, 2, 1, 2), dtype=torch.int16)
    b = torch.ones((2, 3, 1, 2), dtype=torch.int16)
    left = pad_routes([a, b], left=True)
    right = pad_routes([a, b], left=False)
    assert left is not None and right is not None and left.shape == (3, 3, 1, 2)
    assert left[0, :, 0, 0].tolist() == [NO_ROUTE, 0, 0]
    assert right[0, :, 0, 0].tolist() == [0, 0, NO_ROUTE]
    assert pad_routes([a, None], left=True) is None


def test_meter_averages_kl_over_tokens_and_takes_the_max_ratio():
    meter = MismatchMeter(layers=1)
    one = torch.ones((1, 2), dtype=torch.float)
    r_routes = torch.tensor([[[[0, 1]], [[0, 1]]]])
    meter.add(logs(0.5, 0.3), logs(0.25, 0.3), one, r_routes, r_routes)
    meter.add(logs(0.2, 0.3), logs(0.4, 0.3), one, r_routes, r_routes.flip(1) + 1)
    out = meter.result(lambda t: t, lambda t: t)
    # k3 values 0.30685, 0, 0.19315, 0 over 4 tokens; max(r, 1/r) = 2; agreement 2 of 4
    assert out["mismatch/kl"] == pytest.approx((1 - math.log(2) + math.log(2) - 0.5) / 4)
    assert out["mismatch/max_ratio"] == pytest.approx(2.0, rel=1e-6)
    assert out["mismatch/expert_agreement/layer_0"] == 0.5
