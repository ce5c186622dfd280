"""FlatAdamW must step exactly as torch's multi-tensor AdamW: bit for bit, through a step
where a parameter has no gradient, a checkpoint round trip and re-pointed parameters."""

import torch

from workers.rl.flat_adamw import FlatAdamW

SHAPES = [(5, 3), (7,), (4, 4, 2), (16,), (3, 1)]  # sizes off any vector width


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) * 10 ** (i - 2) for i, s in enumerate(SHAPES)]


def run(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: range,
        skip: int | None = None) -> None:
    for t in steps:
        for i, (p, g) in enumerate(zip(ps, grads(t), strict=True)):
            p.grad = None if (t == skip and i == 1) else g.clone()
        opt.step()
        for group in opt.param_groups:  # a schedule moving the LR, as LambdaLR does
            group["lr"] *= 0.97


def test_bit_identical_to_foreach_adamw():
    ref_p, flat_p = params(), params()
    ref = torch.optim.AdamW(ref_p, lr=3e-2, weight_decay=0.1, foreach=True)
    flat = FlatAdamW(flat_p, lr=3e-2, weight_decay=0.1)
    run(ref, ref_p, range(12))
    run(flat, flat_p, range(12))
    assert flat._flat is not None  # it did run flat
    for a, b in zip(ref_p, flat_p, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(ref.state[a]["exp_avg_sq"], flat.state[b]["exp_avg_sq"])
    # a step where one parameter has no gradient: torch skips it (its step count lags);
    # the flat layout cannot share one count any more and stays off, still bit-identical
    run(ref, ref_p, range(12, 20), skip=14)
    run(flat, flat_p, range(12, 20), skip=14)
    assert flat._flat is None
    for a, b in zip(ref_p, flat_p, strict=True):
        assert torch.equal(a, b)
        assert float(ref.state[a]["step"]) == float(flat.state[b]["step"])


def test_state_dict_round_trip_and_re_pointed_parameters():
    ref_p, flat_p = params(1), params(1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=True)
    flat = FlatAdamW(flat_p, lr=1e-2)
    run(ref, ref_p, range(5))
    run(flat, flat_p, range(5))
    saved = flat.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # torch's layout
    # a resumed run: fresh parameters and optimizer loading the saved state
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in flat_p]
    resumed = FlatAdamW(resumed_p, lr=1e-2)
    resumed.load_state_dict(saved)
    run(ref, ref_p, range(5, 9))
    run(resumed, resumed_p, range(5, 9))
    run(flat, flat_p, range(5, 9))
    flat_p[2].data = flat_p[2].data.clone()  # someone re-points a parameter
    run(ref, ref_p, range(9, 11))
    run(flat, flat_p, range(9, 11))
    run(resumed, resumed_p, range(9, 11))
    for a, b, c in zip(ref_p, flat_p, resumed_p, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # the parameters are views of one buffer again after the re-pointed one
    assert flat._flat is not None
    base = flat._flat[0].data_ptr()
    assert flat_p[2].data_ptr() == base + flat._flat[4][2] * 4
