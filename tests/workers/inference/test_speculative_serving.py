"""Speculative decoding on a tiny Qwen3-MoE checkpoint: greedy output token-for-token equal to
plain greedy decoding (n-gram lookup and a draft model), a draft with another tokenizer refused
at load, and a server started with the variant answering chat completions (plain and streamed)
and reporting its acceptance rate on /health."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.workers.inference.conftest import save_tiny_policy
from tests.workers.inference.test_continuous import sequential
from workers.inference import start_server
from workers.inference.engine import (
    EngineOptions,
    Policy,
    SamplingParams,
    SpeculativeBatcher,
    make_batcher,
)
from workers.inference.speculative import DraftModel, DraftModelError
from workers.rl.model import build_policy
from workers.rl.spec import ModelSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=24)


@pytest.fixture(scope="module")
def target(model_dir):
    torch.set_num_threads(1)
    return Policy(model_dir)


@pytest.fixture(scope="module")
def draft_dir(model_dir, target, tmp_path_factory):
    """A one-layer draft with the target's tokenizer (its own random weights)."""
    torch.manual_seed(7)
    return save_tiny_policy(tmp_path_factory.mktemp("draft"), target.tok,
                            TinyMoeSpec(num_layers=1))


@pytest.fixture(scope="module")
def prompts(target):
    """Token-id prompts, some repeating themselves (where prompt lookup finds guesses)."""
    gen = torch.Generator().manual_seed(3)
    eos, pad = target.tok.eos_token_id, target.tok.pad_token_id
    vocab = [i for i in range(len(target.tok)) if i not in (eos, pad)]
    out = []
    for length in (4, 11, 19):
        picks = torch.randint(0, len(vocab), (length,), generator=gen).tolist()
        ids = [vocab[i] for i in picks]
        out.append(ids + ids[: length // 2])
    return out


@pytest.fixture(scope="module")
def expected(target, prompts):
    return [sequential(target, p, GREEDY.max_tokens) for p in prompts]


def run(batcher, prompts) -> list[list[int]]:
    try:
        futures = [batcher.submit([p], 1, GREEDY, None) for p in prompts]
        return [f.result(120)[0][0].token_ids for f in futures]
    finally:
        batcher.close()


def test_ngram_greedy_equals_plain_greedy(target, prompts, expected):
    b = make_batcher(target, 8, EngineOptions(ngram_draft=2, num_speculative_tokens=4))
    assert isinstance(b, SpeculativeBatcher)
    assert run(b, prompts) == expected
    stats = b.stats()["speculative"]
    assert stats["method"] == "ngram" and stats["accepted"] > 0  # guesses were really kept
    assert stats["target_forwards"] < sum(len(e) for e in expected)  # fewer forwards


def test_draft_model_greedy_equals_plain_greedy(target, prompts, expected, draft_dir):
    b = make_batcher(target, 8, EngineOptions(draft_checkpoint=str(draft_dir),
                                              num_speculative_tokens=3))
    assert isinstance(b, SpeculativeBatcher)
    assert run(b, prompts) == expected
    stats = b.stats()["speculative"]
    assert stats["method"] == "draft-model" and stats["proposed"] > 0


def test_the_target_as_its_own_draft_is_always_accepted(target, model_dir, prompts, expected):
    b = make_batcher(target, 8, EngineOptions(draft_checkpoint=str(model_dir)))
    assert run(b, prompts) == expected
    stats = b.stats()["speculative"]
    assert stats["proposed"] > 0 and stats["accepted"] == stats["proposed"]


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    tok = train_bpe(["abc def ghi " * 20], vocab_size=40)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=1)), len(tok),
                         tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(DraftModelError, match="does not share the served model's tokenizer"):
        DraftModel(tmp_path, target.tok, target.vocab_size, target.device, torch.float32)


def test_options_are_checked(target):
    with pytest.raises(ValueError, match="not both"):
        make_batcher(target, 8, EngineOptions(ngram_draft=2, draft_checkpoint="x"))
    with pytest.raises(ValueError, match="num-speculative-tokens must be >= 1"):
        make_batcher(target, 8, EngineOptions(ngram_draft=2, num_speculative_tokens=0))


def test_a_speculative_server_answers_chat_completions(model_dir):
    with start_server(model_dir, name="tiny",
                      engine=EngineOptions(ngram_draft=1, num_speculative_tokens=4)) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "3+4=3+4="}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                           temperature=0, logprobs=True,
                                           extra_body={"return_token_ids": True})
        choice = r.choices[0]
        ids = choice.model_extra["token_ids"]
        assert 1 <= len(ids) <= 12 and r.usage.completion_tokens >= len(ids) - 1
        assert choice.message.content == srv.openai_app.policy.decode(ids)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions
                           .create(model="tiny", messages=msgs, max_tokens=12,
                                   temperature=0, stream=True) if c.choices)
        assert streamed == choice.message.content
        sampled = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                                 temperature=0.8, n=2, seed=5,
                                                 extra_body={"top_k": 20})
        assert len(sampled.choices) == 2
        health = httpx.get(srv.url.removesuffix("/v1") + "/health").json()
        spec = health["speculative"]
        assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
        assert spec["proposed"] >= spec["accepted"] >= 0 and spec["target_forwards"] > 0


def test_the_serve_command_reports_bad_speculative_flags(model_dir, tmp_path, capsys):
    from workers.inference.__main__ import main as cli_main

    base = ["serve", "--model", str(model_dir), "--port", "0"]
    assert cli_main([*base, "--ngram-draft", "2", "--draft-checkpoint", str(model_dir)]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli_main([*base, "--draft-checkpoint", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_logit_bias_request_is_decoded_plainly_with_its_bias(target, prompts):
    """The proposers guess from unbiased logits, so a biased request takes the plain sampler:
    a +100 bias on one token makes every sampled token that one, and no guess is proposed."""
    batcher = make_batcher(target, 4, EngineOptions(ngram_draft=1, num_speculative_tokens=4))
    assert isinstance(batcher, SpeculativeBatcher)
    forced = next(i for i in range(len(target.tok))
                  if i not in (target.tok.eos_token_id, target.tok.pad_token_id))
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=6,
                            logit_bias=((forced, 100.0),))
    try:
        sample = batcher.submit([prompts[0]], 1, params, None).result(120)[0][0]
    finally:
        batcher.close()
    assert sample.token_ids == [forced] * 6
    assert batcher.decoder.proposed == 0
