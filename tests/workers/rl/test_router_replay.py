"""Router replay (R3) and train/infer mismatch on the tiny Qwen3-MoE, on CPU.

The sampler records each token's experts; the trainer's forward (the lean one and the
transformers one with router hooks) replays them; a binding check catches routes applied to
the wrong layer or token; a tiny training run reports the mismatch metrics every step."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.skips import host_reason
from workers.rl.forward import forward_routed, replay_self_test
from workers.rl.model import build_policy
from workers.rl.rollout import HFRollout, RolloutBatch, position_ids
from workers.rl.routing import NO_ROUTE, ReplayBindingError, check_replayed, expert_agreement
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import ModelSpec, RolloutSpec, SpecError, TinyMoeSpec, parse_spec
from workers.rl.trainer import train

CPU = torch.device("cpu")


def recorded(batch: RolloutBatch) -> torch.Tensor:
    assert batch.prompt_routes is not None and batch.completion_routes is not None
    return torch.cat([batch.prompt_routes, batch.completion_routes], 1)


@pytest.fixture(scope="module")
def default_model(tokenizer):
    """The preset's default shape (4 layers, 8 experts, top-2), seed 0."""
    return build_policy(ModelSpec(), len(tokenizer), tokenizer.pad_token_id,
                        tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def bf16_batch(default_model, objective, tokenizer):
    """128 completions sampled by a bf16 copy of the fp32 policy (the transformers forward
    with router hooks records the routes: the lean decoder runs fp32 models only)."""
    prompts = [e.prompt for e in objective.train[:32] for _ in range(4)]
    sampler = copy.deepcopy(default_model).to(torch.bfloat16)
    return HFRollout(sampler, tokenizer).generate(
        prompts, RolloutSpec(max_new_tokens=8, group_size=4), torch.Generator().manual_seed(0))


def test_the_sampler_records_routes_for_every_fed_token(bf16_batch, default_model, tokenizer):
    b = bf16_batch
    assert b.prompt_routes is not None and b.completion_routes is not None
    rows, c = b.completion_ids.shape
    assert b.completion_routes.shape == (rows, c, 4, 2)
    assert b.prompt_routes.shape == (rows, b.prompt_ids.shape[1], 4, 2)
    fed = b.completion_routes[..., 0, 0] >= 0
    # every sampled token but each row's last one (never fed back) has a route; padding none
    assert torch.equal(fed, b.completion_mask.bool() & (torch.arange(c) < c - 1))
    assert torch.equal(b.prompt_routes[..., 0, 0] >= 0, b.prompt_mask.bool())
    assert int(b.completion_routes.max()) < 8
    # the fp32 (lean) sampler records the same layout
    lean = HFRollout(default_model, tokenizer).generate(
        ["1+2=", "1+2="], RolloutSpec(max_new_tokens=4, group_size=2),
        torch.Generator().manual_seed(0))
    assert lean.completion_routes is not None and lean.completion_routes.shape[2:] == (4, 2)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_bf16_sampler_and_fp32_trainer_disagree_without_replay_and_agree_with_it(
        bf16_batch, default_model, lean):
    b = bf16_batch
    p = b.prompt_ids.shape[1]
    with torch.no_grad():
        *_, own = forward_routed(default_model, b, slice(None), True, CPU, lean=lean)
        *_, replayed = forward_routed(default_model, b, slice(None), True, CPU, lean=lean,
                                      replay=True)
    assert own is not None and replayed is not None and b.completion_routes is not None
    counts, n = expert_agreement(b.completion_routes, own[:, p:], b.completion_mask)
    # ~700 routed completion tokens x 4 layers; bf16 rounding flips near-tied routers in
    # about 1-3 % of them (seen on two machines): at least one flip is a safe claim.
    assert n > 500 and int(counts.min()) < n
    counts, n = expert_agreement(b.completion_routes, replayed[:, p:], b.completion_mask)
    assert counts.tolist() == [n] * 4  # exactly 1.0 in every layer
    check_replayed(recorded(b), replayed)  # prompt tokens too


def hand_forced_forward(model: Any, batch: RolloutBatch, routes: torch.Tensor) -> torch.Tensor:
    """The transformers model's forward with every layer's sparse block replaced by the
    block's maths written out here, experts taken from `routes` (B,L,layers,k), weights the
    router's softmax at them, renormalised (norm_topk_prob). Completion logits (B,C,V)."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    flat = routes.flatten(0, 1).long()  # (B*L,layers,k), the block's token order

    def block_forward(block: Any, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])  # (N,D)
        probs = torch.softmax(F.linear(x, block.gate.weight).float(), -1)  # (N,E)
        out = torch.zeros_like(x)
        for tok in range(x.shape[0]):
            chosen = flat[tok, layer]
            if int(chosen.min()) < 0:  # no record (padding): the router's own top-k
                chosen = probs[tok].topk(chosen.shape[0]).indices
            w = probs[tok, chosen] / probs[tok, chosen].sum()
            for j, e in enumerate(chosen.tolist()):
                gate, up = (block.experts.gate_up_proj[e] @ x[tok]).chunk(2)
                out[tok] += w[j] * (block.experts.down_proj[e] @ (F.silu(gate) * up))
        return out.view(hidden.shape)

    blocks = [layer.mlp for layer in model.model.layers]
    try:
        for i, block in enumerate(blocks):
            block.forward = lambda h, block=block, i=i: block_forward(block, i, h)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    finally:
        for block in blocks:
            del block.forward
    p = batch.prompt_ids.shape[1]
    return logits[:, p - 1 : -1]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_replayed_logits_equal_a_forward_with_the_routes_forced_by_hand(tiny_model, lean):
    g = torch.Generator().manual_seed(3)
    n_layers, n_exp, k = 2, 8, 2
    prompt = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 10, 11]])
    p_mask = torch.ones_like(prompt)
    c_ids = torch.randint(3, 16, (3, 4), generator=g)  # the tokenizer has 16 tokens
    c_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])

    def random_routes(rows: int, t: int) -> torch.Tensor:
        return torch.rand((rows, t, n_layers, n_exp), generator=g).argsort(-1)[..., :k]

    p_routes = random_routes(2, 3)[torch.tensor([0, 0, 1])]  # rows 0, 1 share their prompt
    c_routes = random_routes(3, 4).masked_fill(~c_mask.bool()[..., None, None], NO_ROUTE)
    batch = RolloutBatch(prompt, p_mask, c_ids, c_mask, torch.zeros(3, 4), [""] * 3,
                         prompt_routes=p_routes.to(torch.int16),
                         completion_routes=c_routes.to(torch.int16))
    # Padded completion positions have no record and keep the router's own choice: ask the
    # trainer's forward which it used, then force exactly those by hand.
    logits, _, _, used = forward_routed(tiny_model, batch, slice(None), True, CPU, lean=lean,
                                        replay=True)
    assert used is not None
    check_replayed(recorded(batch), used)
    with torch.no_grad():
        want = hand_forced_forward(tiny_model, batch, used)
        plain = forward_routed(tiny_model, batch, slice(None), True, CPU, lean=lean)[0]
    ok = c_mask.bool()
    # fp32, 2 layers, logits of order 1: the two forwards sum experts and attention in
    # different orders, which moves the result by ~1e-7; 1e-5 leaves room and is far below
    # what forcing other experts changes (checked against the unforced forward).
    assert torch.allclose(logits[ok], want[ok], atol=1e-5, rtol=0)
    assert (plain[ok] - want[ok]).abs().max() > 1e-3
    # the router still learns: the loss reaches every layer's router through the weights
    logits[ok].logsumexp(-1).sum().backward()
    for layer in tiny_model.model.layers:
        assert layer.mlp.gate.weight.grad is not None
        assert float(layer.mlp.gate.weight.grad.abs().sum()) > 0


def shifted(batch: RolloutBatch, dim: int) -> RolloutBatch:
    """The batch with its recorded routes moved one layer (dim 2) or one token (dim 1) on:
    what a replay bound to the wrong layers or positions would force."""
    assert batch.prompt_routes is not None and batch.completion_routes is not None
    return dataclasses.replace(batch, prompt_routes=batch.prompt_routes.roll(1, dim),
                               completion_routes=batch.completion_routes.roll(1, dim))


@pytest.mark.parametrize("dim,what", [(2, "layer"), (1, "token")])
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_binding_check_catches_routes_off_by_one_layer_or_token(bf16_batch, default_model,
                                                                   dim, what, lean):
    b = bf16_batch
    sl = slice(0, 16)
    with torch.no_grad():
        *_, used = forward_routed(default_model, shifted(b, dim), sl, True, CPU, lean=lean,
                                  replay=True)
    assert used is not None
    with pytest.raises(ReplayBindingError, match=r"layer \d+ used other experts.*wrong layers"):
        check_replayed(recorded(b)[sl], used)


def test_the_start_up_check_passes_on_the_policy_and_refuses_a_dense_model(tiny_model,
                                                                         tokenizer):
    replay_self_test(tiny_model, len(tokenizer), CPU)

    class Dense(torch.nn.Module):
        config = None

    with pytest.raises(ReplayBindingError, match="cannot be replayed"):
        replay_self_test(Dense(), len(tokenizer), CPU)


TINY = {"preset": {"num_layers": 2, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


@pytest.mark.parametrize("engine", ["batch", "continuous"])
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_tiny_run_reports_mismatch_metrics_every_step(tmp_path, replay, engine):
    """On either rollout engine (`continuous`: the serving scheduler, which records routes
    itself), the fp32 sampler and trainer agree: ratio 1, and with replay every expert."""
    spec = parse_spec({
        "model": TINY, "rollout": {"group_size": 4, "max_new_tokens": 4, "engine": engine},
        "trainer": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4},
        "moe": {"router_replay": replay},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False},
        "output": {"stdout": False}})
    train(spec, JsonlSink(tmp_path / "m.jsonl"))
    steps = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert len(steps) == 2
    for m in steps:
        assert m["mismatch/kl"] >= 0.0 and m["mismatch/max_ratio"] >= 1.0
        # fp32 sampler and trainer: equal to rounding (a stale sampler shows kl ~1e-4)
        assert m["mismatch/kl"] < 1e-6 and m["mismatch/max_ratio"] < 1.001
        agreement = [m[f"mismatch/expert_agreement/layer_{i}"] for i in range(2)]
        assert all(0.9 <= a <= 1.0 for a in agreement)
        if replay:
            assert agreement == [1.0, 1.0]
        assert "mismatch/expert_agreement/layer_2" not in m


def test_replay_is_refused_with_the_vllm_backend_saying_why():
    with pytest.raises(SpecError, match="router_replay.*vLLM backend's routed-experts"):
        parse_spec({"rollout": {"backend": "vllm"}, "moe": {"router_replay": True}})
    assert parse_spec({"moe": {"router_replay": True}}).moe.router_replay


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason=host_reason(
    "probing vLLM's routed-experts output needs a CUDA GPU and vLLM (`pip install .[gpu]`); "
    f"this machine has cuda={torch.cuda.is_available()}, vllm={HAS_VLLM}"))
def test_what_the_installed_vllm_returns_for_routed_experts(tmp_path, tokenizer):
    """Before the vLLM backend may record routes (and the refusal above is lifted), its
    routed experts must come back per generated token as (gen_len, layers, k) expert ids."""
    import vllm

    preset = TinyMoeSpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, num_experts=8, experts_per_token=2,
                         moe_intermediate_size=128, max_position_embeddings=256)
    model = build_policy(ModelSpec(preset=preset), len(tokenizer), tokenizer.pad_token_id,
                         tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    try:
        llm = vllm.LLM(str(tmp_path), enable_return_routed_experts=True,
                       gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True)
    except (TypeError, ValueError) as exc:
        pytest.skip(host_reason(f"vLLM {vllm.__version__} does not return routed experts "
                                f"here ({exc}): router replay stays refused with it"))
    out = llm.generate(["1+2="], vllm.SamplingParams(max_tokens=4, temperature=1.0))[0]
    routes = getattr(out.outputs[0], "routed_experts", None)
    assert routes is not None, f"vLLM {vllm.__version__} accepted the flag, returned no routes"
    routes = torch.as_tensor(routes)
    assert routes.shape[1:] == (2, 2) and int(routes.min()) >= 0 and int(routes.max()) < 8


def test_merged_and_split_batches_keep_each_rows_routes(tiny_model, tokenizer):
    """Curriculum rounds merge batches of different prompt widths and split them per group:
    routes are padded and sliced with the ids, so row r's routes stay row r's."""
    from workers.rl.actor import merge, split_groups

    spec = RolloutSpec(max_new_tokens=3, group_size=2)
    a = HFRollout(tiny_model, tokenizer).generate(["1+2=", "1+2="], spec,
                                                  torch.Generator().manual_seed(0))
    b = HFRollout(tiny_model, tokenizer).generate(["10+20=", "10+20="], spec,
                                                  torch.Generator().manual_seed(1))
    m = merge([a, b], tokenizer.pad_token_id)
    assert m.prompt_routes is not None and m.completion_routes is not None
    assert m.prompt_routes.shape[:2] == m.prompt_ids.shape
    assert m.completion_routes.shape[:2] == m.completion_ids.shape
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 4))):
        assert part.prompt_routes is not None and part.completion_routes is not None
        p, c = part.prompt_ids.shape[1], part.completion_ids.shape[1]
        assert torch.equal(m.prompt_routes[rows, -p:], part.prompt_routes)  # left-padded
        assert torch.equal(m.completion_routes[rows, :c], part.completion_routes)
        assert bool((m.completion_routes[rows, c:] == NO_ROUTE).all())
    first = split_groups(m, 2)[1]
    assert first.completion_routes is not None
    assert torch.equal(first.completion_routes, m.completion_routes[2:4])
