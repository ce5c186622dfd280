"""Balanced experts (workers.rl.balance): the metrics, the z-loss, the sign rule, the global
balance loss against hand-computed values; the aux-free bias on a real router and in the
lean forward; tiny training runs in every `moe.balance` mode; the bias across a resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from workers.rl import balance
from workers.rl.lean import LeanQwen3Moe, supported
from workers.rl.losses import load_balancing_loss
from workers.rl.route_taps import replayable_routers
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import SpecError, parse_spec
from workers.rl.trainer import train

CPU = torch.device("cpu")


# ---- pure functions, by hand -----------------------------------------------------------------


def test_maxvio_and_load_cv_by_hand():
    counts = torch.tensor([[2.0, 4.0, 6.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    # layer 0: mean 3, max 6 -> 6/3 - 1 = 1; deviations -1, 1, 3, -3 -> var 20/4 = 5
    assert balance.maxvio(counts).tolist() == pytest.approx([1.0, 0.0])
    assert balance.load_cv(counts).tolist() == pytest.approx([math.sqrt(5) / 3, 0.0])
    assert balance.maxvio(torch.zeros(1, 4)).tolist() == [0.0]  # no tokens: nothing to say


def test_routing_entropy_is_normalised_by_log_experts():
    sums = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    # uniform -> 1; one expert -> 0; two of four evenly -> ln 2 / ln 4 = 0.5
    assert balance.routing_entropy(sums).tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_z_loss_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3), math.log(3)]]])  # (L=1,N=2,E=2)
    # logsumexp: ln 2 and ln 6
    want = (math.log(2) ** 2 + math.log(6) ** 2) / 2
    assert float(balance.z_loss(logits)) == pytest.approx(want)
    assert float(balance.z_loss(logits, torch.tensor([1.0, 0.0]))) == pytest.approx(
        math.log(2) ** 2)
    # layers are averaged
    two = torch.cat([logits, torch.zeros(1, 2, 2)])
    assert float(balance.z_loss(two)) == pytest.approx((want + math.log(2) ** 2) / 2)


def test_the_sign_rule_by_hand():
    bias = torch.tensor([[0.0, 0.5, 0.0, 0.0]])
    counts = torch.tensor([[1.0, 2.0, 3.0, 6.0]])  # mean 3: under, under, even, over
    out = balance.sign_update(bias, counts, 0.1)
    assert out.tolist() == [pytest.approx([0.1, 0.6, 0.0, -0.1])]


def test_expert_counts_and_prob_sums_by_hand():
    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 2.0, 1.0]]])  # (1,3,3)
    # top-2 per token: {0,1}, {2,1}, {1,2}; the last token masked out
    mask = torch.tensor([1.0, 1.0, 0.0])
    assert balance.expert_counts(logits, 2, mask).tolist() == [[1.0, 2.0, 1.0]]
    # a bias of +1 on expert 2 turns token 0's pick into {0, 2}
    bias = torch.tensor([[0.0, 0.0, 1.0]])
    assert balance.expert_counts(logits, 2, mask, bias).tolist() == [[1.0, 1.0, 2.0]]
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    want = p + p.flip(0)
    assert balance.prob_sums(logits, mask)[0].tolist() == pytest.approx(want.tolist())


def test_the_bias_changes_selection_but_not_the_gating_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    w, idx = balance.biased_topk(logits, None, 2, True)
    assert idx.tolist() == [[0, 1]]
    w, idx = balance.biased_topk(logits, torch.tensor([0.0, 0.0, 1.0, 0.0]), 2, True)
    assert sorted(idx[0].tolist()) == [0, 2]
    # weights: the UNBIASED softmax at the chosen experts, renormalised: e^2 : e^0
    e2 = math.exp(2.0)
    got = dict(zip(idx[0].tolist(), w[0].tolist(), strict=True))
    assert got == {0: pytest.approx(e2 / (e2 + 1)), 2: pytest.approx(1 / (e2 + 1))}
    w.sum().backward()  # the router still learns through the weights
    assert logits.grad is not None


def test_the_bias_hook_on_a_real_router_and_the_lean_forward_agree(tiny_model):
    routers = replayable_routers(tiny_model)
    assert routers is not None
    gate = routers[0]
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_()
    h = torch.randn(5, gate.weight.shape[1])
    _, w0, i0 = gate(h)
    balance.attach(routers)
    assert supported(tiny_model)  # the bias hook does not rule the lean forward out
    e = gate.weight.shape[0]
    with torch.no_grad():
        getattr(gate, balance.BIAS).copy_(torch.arange(e, dtype=torch.float32) * 10.0)
    logits, w1, i1 = gate(h)
    # a huge bias on the last experts: every token now picks the two highest-biased ones
    assert (i1.sort(-1).values == torch.tensor([e - 2, e - 1])).all()
    assert not torch.equal(i0.sort(-1).values, i1.sort(-1).values)
    probs = torch.softmax(logits.float(), -1)
    want = probs.gather(-1, i1)
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w1.float(), want)
    # the lean forward and the transformers forward (with the hook) route and compute alike
    ids = torch.randint(3, tiny_model.config.vocab_size, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    lean = LeanQwen3Moe(tiny_model, 2, 6)
    with torch.no_grad():
        lean_logits, _ = lean.train_forward(ids, mask)
        hf_logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(lean_logits, hf_logits, rtol=1e-4, atol=1e-4)
    assert (lean.routes[:, :, 0].sort(-1).values == torch.tensor([e - 2, e - 1])).all()


def test_global_loss_equals_the_single_batch_loss_when_the_batch_is_not_split():
    torch.manual_seed(1)
    logits = torch.randn(2, 10, 4)  # (L,N,E)
    mask = torch.tensor([1.0] * 8 + [0.0] * 2)
    counts = balance.expert_counts(logits, 2, mask)
    got = balance.global_balance_loss(logits, counts, mask)
    assert float(got) == pytest.approx(float(load_balancing_loss(logits, 2, mask)), rel=1e-6)


def test_global_loss_differs_from_the_mean_of_micro_batch_losses_on_a_split_batch():
    # Two micro-batches, two experts, top-1: A's tokens all prefer expert 0 with p = 3/4,
    # B's all prefer expert 1. The step as a whole is perfectly balanced.
    a = torch.tensor([[[math.log(3), 0.0]] * 4], requires_grad=True)  # (1,4,2)
    b = torch.tensor([[[0.0, math.log(3)]] * 4], requires_grad=True)
    # per micro-batch (transformers): f = (1, 0), P = (3/4, 1/4) -> 2 * 3/4 = 1.5 each
    per_micro = (load_balancing_loss(a, 1) + load_balancing_loss(b, 1)) / 2
    assert float(per_micro.detach()) == pytest.approx(1.5)
    # global: f = (1/2, 1/2) for both -> 2 * (3/8 + 1/8) = 1 each
    counts = balance.expert_counts(a, 1) + balance.expert_counts(b, 1)
    assert counts.tolist() == [[4.0, 4.0]]
    glob = (balance.global_balance_loss(a, counts) + balance.global_balance_loss(b, counts)) / 2
    assert float(glob.detach()) == pytest.approx(1.0)
    # and the balanced step gets no push toward uniform routing inside each micro-batch
    glob.backward()
    assert a.grad is not None and float(a.grad.abs().max()) < 1e-7
    a.grad = None
    per_micro.backward()
    assert float(a.grad.abs().max()) > 1e-3


def test_aux_free_is_refused_with_the_vllm_backend():
    with pytest.raises(SpecError, match="aux_free.*'hf' rollout backend"):
        parse_spec({"rollout": {"backend": "vllm"}, "moe": {"balance": "aux_free"}})
    spec = parse_spec({"moe": {"balance": "global_aux", "z_loss_coef": 1e-3}})
    assert spec.moe.balance == "global_aux" and spec.moe.bias_rate == 1e-3


# ---- tiny training runs -------------------------------------------------------------------

TINY = {"preset": {"num_layers": 2, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


def tiny_spec(tmp_path: Path, moe: dict, steps: int = 2, **trainer: object):
    return parse_spec({
        "model": TINY, "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": steps, "prompts_per_step": 2, "micro_batch_size": 4, **trainer},
        "moe": moe,
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False},
        "output": {"stdout": False}})


def step_metrics(path: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: r["metrics"] for r in read_jsonl(path)
            if r["kind"] == "metrics" and "loss" in r["metrics"]}


@pytest.mark.parametrize("mode", ["aux", "global_aux", "aux_free", "none"])
def test_a_tiny_run_in_each_mode_reports_balance_metrics_with_finite_losses(tmp_path, mode):
    spec = tiny_spec(tmp_path, {"balance": mode, "z_loss_coef": 1e-3, "bias_rate": 0.01})
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"))
    steps = step_metrics(tmp_path / "m.jsonl")
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(v) for v in result.losses.values())
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["z_loss"] > 0.0
        for i in range(2):
            assert m[f"moe/maxvio/layer_{i}"] >= 0.0
            assert m[f"moe/load_cv/layer_{i}"] >= 0.0
            assert 0.0 < m[f"moe/routing_entropy/layer_{i}"] <= 1.0 + 1e-9
        assert "moe/maxvio/layer_2" not in m
        assert ("global_aux_loss" in m) == (mode == "global_aux")
        assert ("moe/bias_absmax/layer_0" in m) == (mode == "aux_free")
    if mode == "aux_free":  # one sign step of 0.01 per step, on every expert off the mean
        assert steps[1]["moe/bias_absmax/layer_0"] == pytest.approx(0.01)


def checkpoint_biases(step_dir: Path) -> torch.Tensor:
    """The routers' biases in a checkpoint's DeepSpeed module state, (L,E) in layer order."""
    files = sorted((step_dir / "ds").glob("mp_rank_*_model_states.pt"))
    assert files, list((step_dir / "ds").iterdir())
    state = torch.load(files[0], weights_only=False)["module"]
    keys = sorted((k for k in state if k.endswith(balance.BIAS)),
                  key=lambda k: int(k.split(".layers.")[1].split(".")[0]))
    return torch.stack([state[k].float() for k in keys])


def test_the_bias_is_checkpointed_and_restored_on_resume(tmp_path):
    # A rate far below the router's probability gaps: no selection flips, so an expert off
    # the mean stays off it and its bias moves one sign step per step.
    rate = 1e-4
    spec = tiny_spec(tmp_path, {"balance": "aux_free", "bias_rate": rate}, steps=4)
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"every": 1, "keep": 5})})
    sink = JsonlSink(tmp_path / "m.jsonl")
    short = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"steps": 3})})
    train(short, sink)
    root = tmp_path / "ckpt"
    b3 = checkpoint_biases(root / "step-000003")
    assert b3.shape == (2, 4)
    assert float(b3.abs().max()) == pytest.approx(3 * rate, rel=1e-4)
    train(spec, sink, resume=True)
    b4 = checkpoint_biases(root / "step-000004")
    # Resumed from b3, step 4 moves each bias by one sign step at most (0 or +-rate); a bias
    # restarted from zero would end within +-rate of zero.
    moved = ((b4 - b3) / rate).round()
    assert torch.allclose(b4 - b3, moved * rate, atol=1e-7)
    assert float(moved.abs().max()) <= 1.0
    assert float(b4.abs().max()) >= 2 * rate


def test_aux_free_with_the_async_actor_samples_with_the_biases(tmp_path):
    """The actor's own policy copy gets the bias buffers, so each weight snapshot (which
    carries them) loads into it."""
    spec = tiny_spec(tmp_path, {"balance": "aux_free", "bias_rate": 0.01}, steps=3,
                     max_async_steps=1)
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"))
    steps = step_metrics(tmp_path / "m.jsonl")
    assert sorted(steps) == [1, 2, 3]
    assert all(math.isfinite(v) for v in result.losses.values())
    assert steps[3]["moe/bias_absmax/layer_0"] > 0.0


TWO_RANKS = """
name = "balance-two-ranks"
[model]
seed = 3
[model.preset]
num_layers = 2
num_experts = 4
hidden_size = 32
moe_intermediate_size = 32
[rollout]
group_size = 4
max_new_tokens = 4
[trainer]
steps = 2
prompts_per_step = 4
micro_batch_size = 4
zero_stage = {zero}
seed = 7
[moe]
balance = "{mode}"
bias_rate = 0.01
[checkpoint]
dir = "{{dir}}/ckpt"
save_final = false
[output]
metrics_jsonl = "{{dir}}/metrics.jsonl"
stdout = true
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,zero", [("global_aux", 2), ("aux_free", 3)])
def test_two_rank_runs_in_the_global_and_aux_free_modes(tmp_path, mode, zero):
    """Under torchrun (2 gloo ranks, ZeRO-2 and ZeRO-3): the global loss's pre-pass loads and
    the step's loads are all-reduced (a rank that skipped or mis-shaped the collective would
    hang or fail the run), and the aux-free bias moves by one sign step per step."""
    from tests.workers.rl.test_rl_distributed import finish, launch

    run_dir = tmp_path / mode
    finish(launch(run_dir, config=TWO_RANKS.format(mode=mode, zero=zero)), run_dir)
    steps = step_metrics(run_dir / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert math.isfinite(m["loss"])
        assert all(m[f"moe/maxvio/layer_{i}"] >= 0.0 for i in range(2))
        # every layer routes the same (rank-summed) tokens, k slots each
        tokens = sum(m[f"moe/layer0/expert{e}_tokens"] for e in range(4))
        assert tokens == sum(m[f"moe/layer1/expert{e}_tokens"] for e in range(4)) > 0
    if mode == "aux_free":
        assert steps[1]["moe/bias_absmax/layer_0"] == pytest.approx(0.01)
