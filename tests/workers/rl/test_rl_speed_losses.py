"""Layer-stacked router statistics must equal the per-layer formulas they replace."""

import math

import pytest
import torch
import torch.nn.functional as F

from workers.rl.losses import expert_utilisation, load_balancing_loss


def per_layer_aux(router_logits, top_k, mask):
    """E * sum_e f_e * P_e layer by layer, averaged (the textbook loop)."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits, -1)
        n_exp = probs.shape[-1]
        assign = F.one_hot(probs.topk(top_k, -1).indices, n_exp).sum(1).float()
        frac = (assign * mask[:, None]).sum(0) / (mask.sum() * top_k)
        prob = (probs * mask[:, None]).sum(0) / mask.sum()
        losses.append(n_exp * (frac * prob).sum())
    return torch.stack(losses).mean()


def test_stacked_aux_loss_and_gradient_match_the_per_layer_loop():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(40, generator=g) > 0.3).float()
    layers = [torch.randn(40, 8, generator=g).requires_grad_() for _ in range(3)]
    fast = load_balancing_loss(layers, 2, mask)
    grads = torch.autograd.grad(fast, layers)
    ref = per_layer_aux(layers, 2, mask)
    ref_grads = torch.autograd.grad(ref, layers)
    assert torch.allclose(fast, ref, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-7)
    assert torch.allclose(load_balancing_loss(torch.stack(layers), 2, mask), ref, atol=1e-6)


def test_stacked_utilisation_counts_each_layer_separately():
    spread = torch.eye(4)
    collapsed = torch.tensor([[0.0, 0, 9, 0]]).repeat(4, 1)
    util = expert_utilisation([spread, collapsed], top_k=1, mask=torch.tensor([1, 1, 1, 0.0]))
    assert util[0]["tokens"] == [1.0, 1.0, 1.0, 0.0]
    assert util[1]["tokens"] == [0.0, 0.0, 3.0, 0.0]
    assert math.isclose(util[0]["load_entropy"], math.log(3) / math.log(4), rel_tol=1e-6)
    assert util[1]["load_entropy"] == 0.0


def test_router_statistics_are_the_aux_loss_and_the_load_metrics_bit_for_bit():
    """One softmax/top-k serves the auxiliary loss and the expert-load metrics: the same
    values, to the bit, as `load_balancing_loss`, `balance.expert_counts` and
    `balance.prob_sums` computed separately, for no mask, a 0/1 mask and packed-token
    weights; the loss keeps its gradient and the sums carry none."""
    from workers.rl import balance
    from workers.rl.losses import router_statistics

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, 8, generator=g).requires_grad_()
    weights = torch.randint(0, 5, (50,), generator=g).float()
    for mask in (None, (weights > 1).float(), weights):
        aux, counts, sums = router_statistics(logits, 2, mask)
        assert torch.equal(aux, load_balancing_loss(logits, 2, mask))
        assert torch.equal(counts, balance.expert_counts(logits, 2, mask))
        assert torch.equal(sums, balance.prob_sums(logits, mask))
        assert aux.requires_grad and not counts.requires_grad and not sums.requires_grad
    layers = list(logits.unbind())
    assert torch.equal(router_statistics(layers, 2, weights)[0],
                       load_balancing_loss(logits, 2, weights))


def test_expert_load_metrics_equal_the_per_layer_loop():
    from workers.rl.trainer import expert_load

    g = torch.Generator().manual_seed(2)
    counts = (torch.rand(4, 8, generator=g) * 300).round()
    counts[2] = 0.0  # a layer without tokens
    want = {}
    for layer, row in enumerate(counts):
        p = row / row.sum().clamp(min=1.0)
        ent = -(p * p.clamp(min=1e-12).log()).sum() / math.log(len(row))
        want[f"moe/layer{layer}/load_entropy"] = float(ent)
        for e, c in enumerate(row.tolist()):
            want[f"moe/layer{layer}/expert{e}_tokens"] = c
    got = expert_load(counts)
    assert list(got) == list(want)
    # Token counts are whole numbers: exact. An entropy sums 8 rounded terms, and a CPU's
    # vector width may order a row's sum differently from a 1-D tensor's: float32 rounding.
    assert {k: v for k, v in got.items() if "tokens" in k} == {
        k: v for k, v in want.items() if "tokens" in k}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
