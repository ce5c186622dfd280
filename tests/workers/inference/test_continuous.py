"""The continuous scheduler (workers/inference/continuous.py) against generation re-done by hand:
greedy tokens equal a plain full-recompute decode of each request alone (fp32, exact), whether
requests run together, join a running batch, prefill in chunks, share a group's prompt or reuse
a cached prefix."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.inference.continuous import ContinuousBatcher
from workers.inference.engine import EngineOptions, SamplingParams, make_batcher

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=24)


@pytest.fixture(scope="module")
def prompts(policy):
    """Token-id prompts of different lengths (3 to 40 tokens) from the tokenizer's vocabulary."""
    gen = torch.Generator().manual_seed(5)
    eos = policy.tok.eos_token_id
    vocab = [t for t in range(len(policy.tok)) if t not in (eos, policy.tok.pad_token_id)]
    out = []
    for length in (3, 9, 17, 40, 6, 25):
        picks = torch.randint(0, len(vocab), (length,), generator=gen).tolist()
        out.append([vocab[i] for i in picks])
    return out


def sequential(policy, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of one prompt by full recompute through the model's own forward."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = policy.model(input_ids=torch.tensor([ids])).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == policy.tok.eos_token_id:
                break
    return out


@pytest.fixture(scope="module")
def expected(policy, prompts):
    return [sequential(policy, p, GREEDY.max_tokens) for p in prompts]


def engine(policy, **kw) -> ContinuousBatcher:
    rows = kw.pop("max_rows", 8)
    b = make_batcher(policy, rows, EngineOptions(engine="continuous", **kw))
    assert isinstance(b, ContinuousBatcher)
    return b


def tokens(future) -> list[list[int]]:
    return [s.token_ids for samples in future.result(120) for s in samples]


def test_batched_greedy_equals_each_request_alone(policy, prompts, expected):
    assert any(len(e) >= 10 for e in expected)  # long enough to cross many decode steps
    b = engine(policy)
    try:
        futures = [b.submit([p], 1, GREEDY, None) for p in prompts]
        got = [tokens(f)[0] for f in futures]
    finally:
        b.close()
    assert got == expected
    assert b.max_running >= 2  # they really ran side by side


def test_requests_join_a_running_batch_and_the_batch_refills(policy, prompts, expected):
    """Two slots for six requests: each finished row's slot goes to a waiting request between
    decode steps. A request submitted while the first one is mid-decode (the scheduler held on
    its first token) joins its batch."""
    b = engine(policy, max_rows=2)
    first_token, go = threading.Event(), threading.Event()

    def hold(_ev) -> None:
        if not first_token.is_set():
            first_token.set()
            go.wait(30)

    try:
        head = b.submit([prompts[3]], 1, GREEDY, None, on_token=hold)
        assert first_token.wait(30)
        steps_before = b.batches
        rest = [b.submit([p], 1, GREEDY, None) for i, p in enumerate(prompts) if i != 3]
        go.set()
        got = tokens(head) + [tokens(f)[0] for f in rest]
    finally:
        b.close()
    assert steps_before == 0  # the others were submitted before its first decode step
    assert got == [expected[3]] + [e for i, e in enumerate(expected) if i != 3]
    assert b.max_running == 2


def test_chunked_prefill_gives_the_same_tokens(policy, prompts, expected):
    b = engine(policy, prefill_chunk=4, prefix_caching=False)
    try:
        futures = [b.submit([p], 1, GREEDY, None) for p in prompts]
        got = [tokens(f)[0] for f in futures]
    finally:
        b.close()
    assert got == expected
    assert b.prefill_tokens == sum(len(p) for p in prompts)


def test_a_group_prefills_its_prompt_once_and_samples_as_unshared(policy, prompts, expected):
    """n=4 samples of one prompt (a GRPO group) prefill it once; greedy they equal the prompt
    sent 4 times as distinct requests with no cache, and seeded sampling is reproducible."""
    shared, unshared = engine(policy), engine(policy, prefix_caching=False)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16)
    try:
        group = tokens(shared.submit([prompts[2]], 4, GREEDY, None))
        assert shared.prefill_tokens == len(prompts[2])
        alone = [tokens(unshared.submit([prompts[2]], 1, GREEDY, None))[0] for _ in range(4)]
        assert unshared.prefill_tokens == 4 * len(prompts[2])
        seeded = tokens(shared.submit([prompts[4]], 4, params, 7))
        again = tokens(unshared.submit([prompts[4]], 4, params, 7))
    finally:
        shared.close()
        unshared.close()
    assert group == alone == [expected[2]] * 4
    assert seeded == again  # with the same seed, a cache hit changes nothing


def test_a_conversation_reuses_its_previous_turn(policy, prompts, expected):
    """The next turn's prompt starts with the previous prompt and its completion: only the
    tokens after the last cached block are prefilled, and the answer is the uncached one."""
    b = engine(policy)
    fresh = engine(policy, prefix_caching=False)
    try:
        turn1 = prompts[3]
        reply = tokens(b.submit([turn1], 1, GREEDY, None))[0]
        turn2 = turn1 + reply + prompts[0]
        fed = b.prefill_tokens
        got = tokens(b.submit([turn2], 1, GREEDY, None))[0]
        want = tokens(fresh.submit([turn2], 1, GREEDY, None))[0]
    finally:
        b.close()
        fresh.close()
    assert reply == expected[3]
    cached = len(turn1) + len(reply) - 1  # the last sampled token was never fed
    assert b.prefill_tokens - fed == len(turn2) - cached // 16 * 16
    assert b.prefix.hits >= 1
    assert got == want == sequential(policy, turn2, GREEDY.max_tokens)


def test_sampling_controls_and_logprobs_match_the_static_engine(policy, prompts):
    """Seeded sampling with top-k, min-p, repetition penalty and top logprobs: the continuous
    engine reports the same logprobs for its tokens as re-scoring them by hand."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, top_logprobs=3,
                            top_k=5, min_p=0.05, repetition_penalty=1.3)
    b = engine(policy)
    try:
        samples = b.submit([prompts[1]], 2, params, 3).result(60)[0]
    finally:
        b.close()
    for s in samples:
        ids = list(prompts[1])
        for tok, lp, alts in zip(s.token_ids, s.logprobs, s.top_logprobs, strict=True):
            with torch.no_grad():
                raw = policy.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            seen = torch.zeros_like(raw, dtype=torch.bool)
            seen[ids] = True
            raw = torch.where(seen, torch.where(raw > 0, raw / 1.3, raw * 1.3), raw)
            logp = torch.log_softmax(raw / 0.8, -1)
            assert lp == pytest.approx(float(logp[tok]), abs=1e-4)
            assert [a for a, _ in alts] == logp.topk(3).indices.tolist()
            ids.append(tok)


def test_too_many_samples_and_empty_prompts_are_refused(policy):
    b = engine(policy, max_rows=2)
    try:
        with pytest.raises(ValueError, match="exceeds"):
            b.submit([[3, 4]], 3, GREEDY, None)
        with pytest.raises(ValueError, match="at least one token"):
            b.submit([[]], 1, GREEDY, None).result(30)
    finally:
        b.close()


@pytest.mark.parametrize("temperature", [1e-6, 1.0])
def test_training_rollout_group_sharing_samples_as_unshared(policy, prompts, temperature):
    """The RL engine's hf backend (`HFRollout`): a GRPO batch (2 prompts x 4 samples) prefilled
    once per prompt gives the tokens and logprobs of prefilling every row, for one seed."""
    from workers.rl.rollout import HFRollout
    from workers.rl.spec import RolloutSpec

    spec = RolloutSpec(max_new_tokens=12, temperature=temperature)
    batch = [prompts[1]] * 4 + [prompts[3]] * 4
    out = {}
    for share in (True, False):
        rollout = HFRollout(policy.model, policy.tok, share_prefix=share)
        uniq, _, rows = rollout.encode(batch)
        assert uniq.shape[0] == (2 if share else 8) and rows.shape == (8,)
        out[share] = rollout.generate(batch, spec, torch.Generator().manual_seed(9))
    assert torch.equal(out[True].completion_ids, out[False].completion_ids)
    assert torch.equal(out[True].completion_mask, out[False].completion_mask)
    assert torch.allclose(out[True].logprobs, out[False].logprobs, atol=1e-5)
    assert out[True].completion_mask.sum() >= 16


def test_rope_scaling_serves_past_the_checkpoint_context(model_dir, capsys):
    """yarn x2 over the checkpoint's 128 positions: the served context is 256, the model's
    rotary embedding is yarn's, and (the lean forward knowing only default RoPE) requests run on
    the static engine."""
    from workers.inference.engine import Batcher
    from workers.inference.server import build_app

    oa = build_app(model_dir, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    try:
        assert oa.policy.context == 256
        assert oa.policy.model.config.rope_parameters["rope_type"] == "yarn"
        assert oa.policy.model.config.rope_parameters["original_max_position_embeddings"] == 128
        assert oa.policy.model.model.rotary_emb.rope_type == "yarn"
        assert isinstance(oa.batcher, Batcher)
        ids = [3] * 150  # longer than the checkpoint's own context
        sample = oa.batcher.submit([ids], 1, SamplingParams(0.0, 1.0, 4), None).result(60)[0][0]
        assert 1 <= len(sample.token_ids) <= 4
    finally:
        oa.close()
    with pytest.raises(ValueError, match="rope_type must be one of"):
        build_app(model_dir, rope_scaling={"rope_type": "magic", "factor": 2.0})
    with pytest.raises(ValueError, match="exceeds the checkpoint's context"):
        build_app(model_dir, max_model_len=4096)
    with pytest.raises(ValueError, match="continuous engine serves a plain fp32 Qwen3-MoE"):
        build_app(model_dir, rope_scaling={"rope_type": "linear", "factor": 2.0},
                  engine=EngineOptions(engine="continuous"))
    from workers.inference.__main__ import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["serve", "--model", str(model_dir), "--rope-scaling", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_prefix_cache_evicts_least_recent_and_never_points_at_evicted_entries():
    """A prompt Y, then its conversation W = Y + more: evicting Y leaves Y's own key pointing
    at W (which starts with it); evicting W later must drop that key too."""
    from workers.inference.continuous import PrefixCache

    cache = PrefixCache(budget_tokens=64)
    kv = [(torch.zeros(1, 40, 1), torch.zeros(1, 40, 1))]
    y = list(range(20))
    w = y + list(range(100, 120))
    cache.insert(y, lambda: kv)
    cache.insert(w, lambda: kv)
    cache.insert(list(range(200, 220)), lambda: kv)  # evicts y: its key now finds w
    assert cache.entries[cache.index[tuple(y)]].tokens == tuple(w)
    cache.insert(list(range(300, 320)), lambda: kv)  # evicts w
    assert cache.tokens == 40 and len(cache.entries) == 2
    for key, eid in cache.index.items():
        assert eid in cache.entries and cache.entries[eid].tokens[: len(key)] == key
    assert cache.lookup(y) == (0, None)
    assert cache.lookup(list(range(200, 220)) + [5])[0] == 16  # its last full block


def test_a_seeded_request_samples_the_same_whatever_runs_beside_it(policy, prompts):
    """Rows move between slots as other requests finish; a seeded request's generator still
    meets its rows in its own order, so its samples are those it draws alone."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=20)
    alone, busy = engine(policy), engine(policy)
    try:
        want = tokens(alone.submit([prompts[0]], 4, params, 21))
        others = [busy.submit([p], 1, SamplingParams(0.0, 1.0, 1 + 2 * i), None)
                  for i, p in enumerate(prompts[1:])]
        got = tokens(busy.submit([prompts[0]], 4, params, 21))
        for f in others:
            f.result(60)
    finally:
        alone.close()
        busy.close()
    assert got == want
