"""A checkpoint the RL engine trained records its prompt format, and the server's defaults use
it: chat clients get the accuracy raw completions get (they got 0/40 where raw got 27/40)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from workers.inference import start_server
from workers.rl.objectives import build_objective
from workers.rl.sinks import NullSink
from workers.rl.spec import parse_spec
from workers.rl.trainer import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer tiny MoE warm-started on the arithmetic references (seconds on a CPU)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("trained")
    spec = parse_spec({
        "model": {"preset": {"num_layers": 2}},
        "sft": {"steps": 150, "batch_size": 32},
        "rollout": {"group_size": 2, "max_new_tokens": 3},
        "trainer": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                    "eval_samples": 1},
        "checkpoint": {"dir": str(folder)},
        "output": {"stdout": False},
    })
    result = train(spec, NullSink())
    return result.final_dir, build_objective(spec.task)


def test_checkpoints_record_the_prompt_format_they_were_trained_with(trained):
    final, _ = trained
    root = final.rsplit("/", 1)[0]
    for folder in (final, f"{root}/sft"):
        with open(f"{folder}/prompt_format.json") as f:
            assert json.load(f) == {"format": "raw", "layout": "single_turn"}


def test_served_with_defaults_chat_scores_as_raw_completions(trained):
    final, objective = trained
    with start_server(final, name="policy") as srv:  # the README's serve command's defaults
        assert srv.openai_app.policy.chat_format == "raw"
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
        prompts = [e.prompt for e in objective.eval]
        raw = client.completions.create(model="policy", prompt=prompts, max_tokens=3,
                                        temperature=0)
        raw_text = [c.text for c in sorted(raw.choices, key=lambda c: c.index)]
        chat_text = [client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": p}], max_tokens=3,
            temperature=0).choices[0].message.content for p in prompts]
    raw_score, _ = objective.reward(objective.eval, raw_text)
    chat_score, _ = objective.reward(objective.eval, chat_text)
    print(f"held-out greedy exact match: raw {sum(raw_score)}/{len(prompts)}, "
          f"chat {sum(chat_score)}/{len(prompts)}")
    assert sum(raw_score) >= 2  # the model learned something, so equality is not 0 == 0
    assert chat_text == raw_text and chat_score == raw_score


def test_the_episode_layout_is_the_text_the_engine_plays_episodes_in():
    from workers.rl.episodes import PlainCodec
    from workers.rl.prompt_format import render
    from workers.rl.tokenizer import train_bpe

    tok = train_bpe(["fix the bug: def f(): return 1\ntests failed: f() != 2\n"], 96)
    codec = PlainCodec(tok)
    chat = [("user", "fix the bug"), ("assistant", "def f(): return 1"),
            ("user", "tests failed: f() != 2")]
    ids = (codec.encode_message({"role": "user", "content": chat[0][1]})
           + tok(chat[1][1], add_special_tokens=False)["input_ids"] + codec.end_of_turn
           + codec.after_turn + codec.encode_message({"role": "user", "content": chat[2][1]}))
    assert render(chat, "episode", tok.eos_token) == tok.decode(ids)
    assert render(chat[:1], "single_turn", tok.eos_token) == "fix the bug"
    with pytest.raises(ValueError, match="cannot continue an assistant message"):
        render(chat[:2], "single_turn", tok.eos_token)


def test_eos_is_not_text_but_rl_clients_get_it_as_a_token(trained):
    """The SFT'd model ends its answers with eos: not in the text, the logprobs or
    completion_tokens (streamed or not); TRL's vLLM client (its own request and parsing code,
    token-id prompts, `return_tokens_as_token_ids`, top_k / min_p / repetition_penalty) gets
    the sampled ids with the eos and a logprob for each."""
    requests = pytest.importorskip("requests")
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    final, objective = trained
    prompts = [e.prompt for e in objective.eval[:6]]
    with start_server(final, name="policy") as srv:
        eos = srv.openai_app.policy.tok.eos_token_id
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
        kw = {"model": "policy", "prompt": prompts, "max_tokens": 4, "temperature": 0,
              "logprobs": 0, "extra_body": {"return_token_ids": True}}
        r = client.completions.create(**kw)
        ended = [c.model_extra["token_ids"][-1] == eos for c in r.choices]
        assert sum(ended) >= 3  # the model learned to stop
        for c, stop in zip(r.choices, ended, strict=True):
            ids = c.model_extra["token_ids"]
            assert len(c.logprobs.tokens) == len(ids) - stop
            assert c.finish_reason == ("stop" if stop else "length")
            assert "<eos>" not in "".join(c.logprobs.tokens) + c.text
        assert r.usage.completion_tokens == sum(
            len(c.model_extra["token_ids"]) for c in r.choices) - sum(ended)
        chunks = list(client.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage == r.usage
        streamed = [t for ch in chunks[:-1] for c in ch.choices if c.logprobs
                    for t in c.logprobs.tokens]
        assert streamed and "<eos>" not in streamed

        trl = vllm_client.VLLMClient.__new__(vllm_client.VLLMClient)  # no weight-sync setup
        trl.session, trl.base_url, trl.model = requests.Session(), srv.url[:-3], "policy"
        prompt_ids = [srv.openai_app.policy.encode(p) for p in prompts]
        out = trl.generate(prompts=prompt_ids, n=2, temperature=1.0, top_k=5, min_p=0.05,
                           repetition_penalty=1.1, max_tokens=4, generation_kwargs={"seed": 1})
    assert out["prompt_ids"] == prompt_ids
    assert len(out["completion_ids"]) == 2 * len(prompts)
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"],
                                out["logprob_token_ids"], strict=True):
        assert len(lps) == len(ids) and [alts[0] for alts in lp_ids] == ids
        assert all(lp[0] <= 0.0 for lp in lps)
    assert any(ids[-1] == eos for ids in out["completion_ids"])
