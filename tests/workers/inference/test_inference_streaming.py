"""Streaming through the official `openai` client: token by token while the batch still samples,
`n > 1` interleaved, each choice's finish, a final usage chunk; vLLM-style top_k, min_p and
repetition_penalty, checked against sampling re-done by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.rl.rollout import min_p_filter, repetition_penalty, top_k_filter

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "2+5="}], "max_tokens": 8,
        "seed": 3, "n": 2, "temperature": 1.0}


def test_chunks_arrive_while_the_batch_is_still_sampling(client, server, monkeypatch):
    """The sampler is held after its first token until the client has read that token's
    chunk: the chunk cannot have come from a finished generation."""
    read_one, released = threading.Event(), threading.Event()
    held: list[bool] = []
    batcher = server.openai_app.batcher
    submit = batcher.submit

    def gated(prompts, n, params, seed, on_token=None):
        seen = [0]

        def relay(ev):
            on_token(ev)
            seen[0] += 1
            if seen[0] == 1:  # the scheduler's thread waits here, mid-generation
                held.append(read_one.wait(timeout=60))
                released.set()

        return submit(prompts, n, params, seed, on_token=relay if on_token else None)

    body = {**CHAT, "n": 1, "max_tokens": 12, "temperature": 0, "logprobs": True}
    full = client.chat.completions.create(**body).choices[0]
    assert len(full.logprobs.content) >= 2  # more to sample after the first token
    monkeypatch.setattr(batcher, "submit", gated)
    stream = client.chat.completions.create(**body, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:  # the first token's own chunk
            assert chunk.choices[0].logprobs.content[0].token == \
                full.logprobs.content[0].token
            read_one.set()  # read while the sampler is still held
            break
    read_one.set()
    stream.close()
    assert released.wait(timeout=60)
    assert held == [True]  # the chunk was read before the sampler was let go


def test_streamed_chat_is_the_same_completion_token_by_token_interleaved(client, policy):
    full = client.chat.completions.create(**CHAT, logprobs=True)
    chunks = list(client.chat.completions.create(**CHAT, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, finish = ["", ""], [None, None]
    logprobs: list[list[float]] = [[], []]
    order = []
    for ch in chunks[:-1]:
        [c] = ch.choices
        order.append(c.index)
        texts[c.index] += c.delta.content or ""
        finish[c.index] = c.finish_reason or finish[c.index]
        if c.logprobs:
            logprobs[c.index] += [e.logprob for e in c.logprobs.content]
    assert texts == [c.message.content for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices]
    for i, c in enumerate(full.choices):
        assert logprobs[i] == pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-5)
        # one chunk per token shown: the text came piece by piece, not in one chunk
        assert len(logprobs[i]) == len(c.logprobs.content) > 1
    # n = 2 interleaved: choice 1 speaks before choice 0 has finished
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage == full.usage
    assert usage.usage.completion_tokens == sum(len(c.logprobs.content) for c in full.choices)


def test_streamed_completions_stop_strings_and_logprobs(client):
    base = client.completions.create(model="tiny", prompt="4+4=", max_tokens=10,
                                     temperature=0).choices[0]
    stop = base.text[2]
    kw = {"model": "tiny", "prompt": ["4+4=", "1+2="], "max_tokens": 10, "temperature": 0,
          "stop": [stop], "logprobs": 2, "n": 2}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {c.index: "" for c in full.choices}
    tokens = {c.index: [] for c in full.choices}
    finish = {}
    for ch in chunks[:-1]:
        [c] = ch.choices
        texts[c.index] += c.text
        if c.logprobs:
            tokens[c.index] += c.logprobs.tokens
            assert len(c.logprobs.top_logprobs[0]) == 2
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    for c in full.choices:
        assert texts[c.index] == c.text and stop not in c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert finish[c.index] == c.finish_reason
    assert full.choices[0].text == base.text[: base.text.index(stop)]
    assert chunks[-1].usage == full.usage


def test_top_k_min_p_and_repetition_penalty_sample_as_specified(client, policy):
    prompt = "7+8="
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                       temperature=0, extra_body={"return_token_ids": True})
    ids = greedy.choices[0].model_extra["token_ids"]
    # top_k = 1 and min_p = 1 leave only the most likely token: sampling at T=1 is greedy.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=3,
                                      temperature=1.0, seed=5,
                                      extra_body={**extra, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in r.choices] == [ids] * 3, extra
    # Greedy under a repetition penalty, re-done by hand: the penalty on every token already
    # in the prompt or the output, then argmax.
    pen = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"repetition_penalty": 1.8,
                                                "return_token_ids": True})
    got = pen.choices[0].model_extra["token_ids"]
    context = policy.tok(prompt, add_special_tokens=False)["input_ids"]
    expect: list[int] = []
    while len(expect) < len(got):
        with torch.no_grad():
            logits = policy.model(input_ids=torch.tensor([context + expect])).logits[0, -1]
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(context + expect)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.8, logits * 1.8), logits)
        expect.append(int(logits.argmax()))
        if expect[-1] == policy.tok.eos_token_id:
            break
    assert got == expect


def test_the_sampling_filters_on_hand_computed_values():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert top_k_filter(probs, 2)[0].tolist() == pytest.approx([0.625, 0.375, 0.0])
    assert top_k_filter(probs, 0).tolist() == probs.tolist()  # off
    assert min_p_filter(probs, 0.5)[0].tolist() == pytest.approx([0.625, 0.375, 0.0])
    assert min_p_filter(probs, 0.0).tolist() == probs.tolist()
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    seen = torch.tensor([[True, True, False]])
    assert repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0]]
