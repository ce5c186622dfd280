"""The OpenAI-compatible inference server, driven by the official `openai` client against a tiny
Qwen3-MoE built from a config and saved like an RL checkpoint (no downloads)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch

from tests.workers.inference.conftest import KEY
from workers.inference.__main__ import main as cli_main
from workers.inference.engine import Batcher, SamplingParams, plain_chat, raw_chat
from workers.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from workers.rl.rollout import position_ids


def _scores(policy, prompt: str, completion: list[int], temperature: float) -> list[float]:
    """Log-probs of `completion` after `prompt`, recomputed independently of the server."""
    p = policy.tok(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + completion])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = policy.model(input_ids=ids, attention_mask=mask,
                              position_ids=position_ids(mask)).logits[0, len(p) - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_models_are_listed_and_retrievable(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "crucible"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_chat_completion_counts_tokens_and_returns_sampling_logprobs(client, policy):
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}]
    r = client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=5,
                                       temperature=0.7, logprobs=True, seed=11,
                                       extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and len(r.choices) == 3
    prompt = plain_chat([("system", "add"), ("user", "3+4=")])
    prompt_ids = policy.tok(prompt, add_special_tokens=False)["input_ids"]
    assert r.model_extra["prompt_token_ids"] == prompt_ids
    completion_tokens = 0
    for i, choice in enumerate(r.choices):
        ids = choice.model_extra["token_ids"]
        assert choice.index == i and 1 <= len(ids) <= 5
        assert choice.finish_reason == ("length" if len(ids) == 5 else "stop")
        lps = [c.logprob for c in choice.logprobs.content]
        # The eos is a stop signal: in token_ids (what an RL client trains on), not in logprobs
        # or usage.
        text_ids = ids[:-1] if ids[-1] == policy.tok.eos_token_id else ids
        assert len(lps) == len(text_ids)
        # The server reports the sampling policy's log-probs: log_softmax(logits / T).
        assert lps == pytest.approx(_scores(policy, prompt, ids, 0.7)[: len(text_ids)],
                                    abs=1e-4)
        assert choice.message.content == policy.tok.decode(ids, skip_special_tokens=True)
        completion_tokens += len(text_ids)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == completion_tokens
    assert r.usage.total_tokens == len(prompt_ids) + completion_tokens


def test_seed_makes_sampling_reproducible(client):
    def run(seed):
        r = client.completions.create(model="tiny", prompt="12+7=", n=4, max_tokens=8,
                                      seed=seed)
        return [c.text for c in r.choices]

    first = run(5)
    assert run(5) == first
    assert run(6) != first


def test_greedy_decoding_matches_argmax_and_reports_model_logprobs(client, policy):
    r = client.completions.create(model="tiny", prompt=["1+1=", "9*9="], n=2, max_tokens=6,
                                  temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(["1+1=", "9*9="]):
        a, b = r.choices[2 * p], r.choices[2 * p + 1]
        assert a.text == b.text
        ids = a.model_extra["token_ids"]
        # Argmax decoding, re-done by hand.
        expect: list[int] = []
        for _ in range(len(ids)):
            ctx = policy.tok(prompt, add_special_tokens=False)["input_ids"] + expect
            with torch.no_grad():
                logits = policy.model(input_ids=torch.tensor([ctx])).logits[0, -1]
            expect.append(int(logits.argmax()))
        assert ids == expect
        lp = a.logprobs
        assert lp.token_logprobs == pytest.approx(_scores(policy, prompt, ids, 1.0), abs=1e-4)
        for j, alts in enumerate(lp.top_logprobs):
            assert len(alts) == 3
            assert max(alts.values()) == pytest.approx(lp.token_logprobs[j], abs=1e-5)
        assert lp.text_offset[0] == 0


def test_stop_strings_cut_the_text_and_finish_with_stop(client):
    base = client.completions.create(model="tiny", prompt="4+4=", max_tokens=10,
                                     temperature=0).choices[0]
    assert base.finish_reason == "length" and len(base.text) >= 3, base.text
    stop = base.text[2]
    cut = client.completions.create(model="tiny", prompt="4+4=", max_tokens=10,
                                    temperature=0, stop=[stop, "never"]).choices[0]
    assert cut.text == base.text[: base.text.index(stop)]
    assert cut.finish_reason == "stop"


def test_streaming_chat_delivers_the_same_text_and_usage(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "2+5="}],
          "max_tokens": 6, "seed": 3, "n": 2}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, finish = ["", ""], [None, None]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices]
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    with client.chat.completions.stream(**kw) as stream:  # the SDK's stream accumulator
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot
    assert [c.message.content for c in snapshot.choices] == texts


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        ({"logit_bias": {"5": 300}}, "logit_bias", "between -100 and 100"),
        ({"max_tokens": 1000}, "max_tokens", "maximum context length is 128"),
        ({"messages": []}, "messages", "at least 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"presence_penalty": 0.5}, "presence_penalty", "penalties are not supported"),
        ({"top_k": -3}, "top_k", "greater than or equal to -1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"ignore_eos": True}, "", "ignore_eos=True is not supported"),
    ],
)
def test_bad_chat_requests_get_openai_errors(client, body, param, fragment):
    with pytest.raises(openai.BadRequestError) as err:  # extra_body overrides the fields
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                "content": "1+2="}],
                                       extra_body=body)
    error = err.value.body
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0] == param
    assert fragment in error["message"]


def test_nulls_and_neutral_vllm_extensions_are_accepted(client):
    """Accepted, and neutral: the same seeded request without them samples the same tokens.
    (An untrained model may sample its eos first, so the completion may be empty: comparing
    with the plain request holds on any machine, a token count does not.)"""
    messages = [{"role": "user", "content": "1+2="}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, seed=7,
        extra_body={"n": None, "temperature": None, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "reasoning_effort": None})
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                           seed=7)
    assert len(r.choices) == 1
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason
    assert r.usage.completion_tokens == plain.usage.completion_tokens


def test_transport_level_errors_are_json(server, client):
    auth = {"authorization": f"Bearer {KEY}"}
    base = server.url
    bad_json = httpx.post(f"{base}/chat/completions", content=b"{nope", headers=auth)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    missing = httpx.get(f"{base}/embeddings", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x")
    assert err.value.body["code"] == "model_not_found"
    tokens = httpx.post(f"{base}/completions", headers=auth,
                        json={"model": "tiny", "prompt": [[1, 2, 99999]]})
    assert tokens.status_code == 400
    assert "token id 99999, outside this model's vocabulary" in tokens.json()["error"]["message"]


def test_concurrent_requests_share_batches(policy):
    batcher = Batcher(policy, max_rows=64)
    try:
        slow = batcher.submit(["5+5="] * 16, 1, SamplingParams(1.0, 1.0, 40), None)
        params = SamplingParams(0.9, 1.0, 4)
        small = [batcher.submit([f"{i}+1="], 2, params, None) for i in range(4)]
        assert len(slow.result(60)) == 16
        results = [f.result(60) for f in small]
    finally:
        batcher.close()
    assert [len(r) == 1 and len(r[0]) == 2 for r in results] == [True] * 4
    assert batcher.batches == 2  # the four small requests queued behind the slow one, merged


def test_parallel_http_clients_all_get_answers(client):
    out: list[str] = []

    def ask(i: int) -> None:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"{i}+{i}="}], max_tokens=3)
        out.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) and len(out) == 6 and set(out) <= {"stop", "length"}


@pytest.mark.parametrize(
    ("cls", "body", "param", "fragment"),
    [
        (CompletionRequest, {"model": "m", "prompt": ["x"] * 1025}, "prompt", "at most 1024"),
        (CompletionRequest, {"model": "m"}, "prompt", "Missing required parameter"),
        (ChatCompletionRequest,
         {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content.0.type", "should be 'text'"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]},
         "messages.0.role", "'user'"),
    ],
)
def test_validation_errors_name_the_parameter(cls, body, param, fragment):
    with pytest.raises(ApiError) as err:
        parse_request(cls, body)
    assert err.value.param == param and fragment in err.value.message


def test_chat_formats():
    msgs = [("system", "be brief"), ("user", "3+4=")]
    assert plain_chat(msgs) == "system: be brief\nuser: 3+4=\nassistant:"
    assert raw_chat([("user", "3+4=")]) == "3+4="
    assert raw_chat(msgs) == "be brief\n\n3+4="  # the RL engine's single-turn rendering
    with pytest.raises(ValueError, match="cannot continue"):
        raw_chat([("user", "a"), ("assistant", "b")])


def test_cli_refuses_a_directory_without_a_model(tmp_path, capsys):
    assert cli_main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["serve", "--model", str(tmp_path / "empty"), "--port", "0"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_error_body_is_json_for_every_route(server):
    r = httpx.post(f"{server.url}/completions", json=["not", "an", "object"],
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    assert json.loads(r.text)["error"]["message"] == "the request body must be a JSON object"
