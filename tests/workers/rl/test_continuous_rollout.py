"""Training rollouts on the server's continuous scheduler (`rollout.engine = "continuous"`,
workers/rl/continuous.py): the batch the trainer gets is laid out as the batch engine's, its
logprobs are what the trainer's forward recomputes, its routes are the experts each token went
through, every call samples from the weights as they are then, and a multi-turn context reuses
the keys of the turn before it. (Training runs on it: test_router_replay.py's tiny runs and
test_rl_multiturn.py's code-repair runs take both engines.)"""

from __future__ import annotations

import pytest
import torch

from workers.rl.continuous import ContinuousRollout, weights_version
from workers.rl.forward import forward_routed
from workers.rl.rollout import HFRollout, make_backend
from workers.rl.routing import expert_agreement
from workers.rl.spec import RolloutSpec, SpecError, parse_spec

CPU = torch.device("cpu")
GREEDY = RolloutSpec(max_new_tokens=6, temperature=1e-6)


@pytest.fixture
def backend(tiny_model, tokenizer):
    b = ContinuousRollout(tiny_model, tokenizer)
    yield b
    b.close()


def same_batches(a, b) -> None:
    assert torch.equal(a.prompt_ids, b.prompt_ids)
    assert torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert a.texts == b.texts


def rescore_error(model, batch, temperature: float) -> float:
    """The largest gap between the sampler's logprobs and the trainer's forward's."""
    with torch.no_grad():
        logits, *_ = forward_routed(model, batch, slice(None), True, CPU)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    trainer = logp.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    mask = batch.completion_mask.bool()
    return float((batch.logprobs[mask] - trainer[mask]).abs().max())


def test_greedy_rollouts_equal_the_batch_engines(backend, tiny_model, tokenizer):
    """Groups (3 prompts x 4), a batch of distinct prompts, and token-id prompts: the same
    tokens, mask, texts and prompt layout as `HFRollout`, and the same route layout."""
    groups = [p for p in ("1+2=", "13+4=", "9+9=") for _ in range(4)]
    mixed = ["1+2=", "13+4=", "1+2=", "5+"]  # not runs of one size: submitted row by row
    ids = [tokenizer("12+7=", add_special_tokens=False)["input_ids"]] * 2
    for prompts in (groups, mixed, ids):
        ours = backend.generate(prompts, GREEDY, torch.Generator().manual_seed(0))
        want = HFRollout(tiny_model, tokenizer).generate(prompts, GREEDY,
                                                         torch.Generator().manual_seed(0))
        same_batches(ours, want)
        assert ours.completion_routes is not None and want.completion_routes is not None
        assert ours.completion_routes.shape == want.completion_routes.shape
        assert ours.prompt_routes is not None and want.prompt_routes is not None
        assert torch.equal(ours.prompt_routes < 0, want.prompt_routes < 0)
        assert torch.equal(ours.completion_routes < 0, want.completion_routes < 0)


def test_sampled_logprobs_and_routes_are_what_the_trainer_recomputes(backend, tiny_model,
                                                                     tokenizer):
    """At temperature 1.3, the logprob of every sampled token is the trainer's own (importance
    ratio 1) and its recorded experts are the ones the trainer's forward picks."""
    spec = RolloutSpec(max_new_tokens=8, temperature=1.3)
    prompts = [p for p in ("1+2=", "13+4=", "9+9=", "40+2=") for _ in range(8)]
    batch = backend.generate(prompts, spec, torch.Generator().manual_seed(3))
    mask = batch.completion_mask.bool()
    assert int(mask.sum()) > 64 and len(set(batch.texts)) > 4  # it sampled, not one answer
    p = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits, _, _, routes = forward_routed(tiny_model, batch, slice(None), True, CPU)
    logp = torch.log_softmax(logits.float() / spec.temperature, -1)
    trainer = logp.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    assert torch.allclose(batch.logprobs[mask], trainer[mask], atol=1e-4)
    assert routes is not None and batch.completion_routes is not None
    counts, n = expert_agreement(batch.completion_routes, routes[:, p:], batch.completion_mask)
    # fp32 on both sides, computed in a different order: a router tie within rounding could
    # flip one token's experts, so all but 1 % must agree (exactly equal when none does).
    assert n > 32 and all(c >= 0.99 * n for c in counts.tolist())
    assert batch.prompt_routes is not None
    counts, n = expert_agreement(batch.prompt_routes, routes[:, :p], batch.prompt_mask)
    assert n > 32 and all(c >= 0.99 * n for c in counts.tolist())


def test_the_same_generator_state_gives_the_same_samples(tiny_model, tokenizer):
    spec = RolloutSpec(max_new_tokens=6, temperature=1.0)
    prompts = [p for p in ("1+2=", "3+3=") for _ in range(4)]
    a, b = ContinuousRollout(tiny_model, tokenizer), ContinuousRollout(tiny_model, tokenizer)
    try:
        b.generate(["7+7="] * 2, spec, torch.Generator().manual_seed(1))  # b has history
        first = a.generate(prompts, spec, torch.Generator().manual_seed(11))
        second = b.generate(prompts, spec, torch.Generator().manual_seed(11))
    finally:
        a.close()
        b.close()
    same_batches(first, second)
    assert torch.equal(first.logprobs, second.logprobs)


def test_each_call_samples_from_the_weights_as_they_are_then(backend, tiny_model, tokenizer):
    """An optimizer step between two calls: the second samples the new weights (as a fresh
    batch engine does), not the fused copies or cached keys of the old ones."""
    prompt = [3 + i % 12 for i in range(20)]  # 20 tokens: kept by the prefix cache
    before = backend.generate([prompt], GREEDY, torch.Generator().manual_seed(0))
    assert backend.scheduler is not None and backend.scheduler.prefix.tokens > 0
    version = weights_version(tiny_model)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=5.0)
    ids = torch.cat([before.prompt_ids, before.completion_ids], 1)
    loss = tiny_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert weights_version(tiny_model) != version
    after = backend.generate([prompt], GREEDY, torch.Generator().manual_seed(0))
    want = HFRollout(tiny_model, tokenizer).generate([prompt], GREEDY,
                                                     torch.Generator().manual_seed(0))
    same_batches(after, want)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    # An optimizer that moved the parameters onto views of a flat buffer (workers/rl/
    # flat_adamw.py) writes without bumping their versions: the trainer says so instead.
    params = list(tiny_model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        p.data = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    backend.generate([prompt], GREEDY, torch.Generator().manual_seed(0))  # cached again
    version = weights_version(tiny_model)
    with torch.no_grad():
        flat.mul_(0.5)
    assert weights_version(tiny_model) == version  # invisible to the version counters
    backend.sync_weights(tiny_model)
    sampled = RolloutSpec(max_new_tokens=8, temperature=1.0)
    halved = backend.generate([prompt] * 4, sampled, torch.Generator().manual_seed(0))
    assert rescore_error(tiny_model, halved, 1.0) < 1e-4  # not the old weights' keys


def test_a_multi_turn_context_prefills_only_its_new_tokens(backend, tiny_model, tokenizer):
    """Turn 2's prompt is turn 1's prompt, its completion and a tool result: only what is
    new is prefilled, and the tokens are those of decoding turn 2 from scratch."""
    turn1 = [3 + i % 12 for i in range(32)]  # of the 16-token vocabulary, no pad or eos
    spec = RolloutSpec(max_new_tokens=8, temperature=1e-6)
    first = backend.generate([turn1], spec, torch.Generator().manual_seed(0))
    completion = first.completion_ids[0][first.completion_mask[0].bool()].tolist()
    turn2 = turn1 + completion + [5, 6, 7, 8]
    sched = backend.scheduler
    assert sched is not None
    fed = sched.prefill_tokens
    second = backend.generate([turn2], spec, torch.Generator().manual_seed(0))
    new = sched.prefill_tokens - fed
    assert new < len(turn2) - len(turn1) + 16  # at most one partial block beyond the new part
    want = HFRollout(tiny_model, tokenizer).generate([turn2], spec,
                                                     torch.Generator().manual_seed(0))
    same_batches(second, want)


def test_the_engine_is_chosen_in_the_spec_and_refused_where_it_cannot_run(tiny_model,
                                                                         tokenizer):
    assert isinstance(make_backend("hf", tiny_model, tokenizer, False, "continuous"),
                      ContinuousRollout)
    assert type(make_backend("hf", tiny_model, tokenizer, False)) is HFRollout
    with pytest.raises(ValueError, match="lockstep"):
        make_backend("hf", tiny_model, tokenizer, True, "continuous")
    with pytest.raises(ValueError, match="plain fp32 Qwen3-MoE"):
        ContinuousRollout(tiny_model.to(torch.bfloat16), tokenizer)
    with pytest.raises(SpecError, match="continuous.*'hf' backend"):
        parse_spec({"rollout": {"backend": "vllm", "engine": "continuous"}})
    with pytest.raises(SpecError, match="lockstep"):
        parse_spec({"rollout": {"engine": "continuous"}, "trainer": {"zero_stage": 3}})
