"""Layer-stacked router statistics must equal the per-layer formulas they replace."""

import math

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
