"""Structured output (`response_format`) through the official `openai` client against the real
server, a tiny random Qwen3-MoE and llguidance's grammar masks. The tokenizer is trained on
every printable ASCII character so JSON's quotes, braces and field names are all spellable.

A random model under a json_object mask may wander in a string for hundreds of tokens, so the
json_object requests add a `logit_bias` towards `"`, `}` and `]`: the grammar still decides
where each is legal (a biased token it forbids stays at -inf), and the bias only makes the
object close well within max_tokens on any machine. The schema requests need no bias: their
schema leaves the model a digit and an enum choice, the rest is forced."""

from __future__ import annotations

import json
import string
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.workers.inference.conftest import save_tiny_policy
from workers.inference.engine import Batcher, EngineOptions, SamplingParams, make_batcher
from workers.inference.grammar import GrammarError, JsonGrammars
from workers.rl.objectives import build_objective
from workers.rl.rollout import constrain
from workers.rl.spec import ArithmeticSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe

ASK = [{"role": "user", "content": "Give me JSON."}]
JSON_OBJECT = {"type": "json_object"}


class Answer(BaseModel):
    digit: int = Field(ge=0, le=9)
    sign: Literal["plus", "minus"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Overrides conftest's: the tiny policy with a tokenizer that spells any ASCII text."""
    tok = train_bpe([*build_objective(ArithmeticSpec()).corpus(), string.printable],
                    vocab_size=256)
    return save_tiny_policy(tmp_path_factory.mktemp("policy-json"), tok,
                            TinyMoeSpec(num_layers=2, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def closers(policy) -> dict[str, float]:
    ids = [policy.tok.convert_tokens_to_ids(c) for c in '"}]']
    assert all(isinstance(i, int) and i >= 0 for i in ids)
    return {str(i): 8.0 for i in ids}


@pytest.mark.parametrize(("temperature", "seed"), [(1.0, 0), (1.0, 1), (1.0, 2), (0.0, None)])
def test_json_object_replies_parse_to_a_dict(client, closers, temperature, seed):
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format=JSON_OBJECT,
                                       temperature=temperature, seed=seed, max_tokens=96,
                                       logit_bias=closers)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_parse_returns_an_instance_of_the_schema(client):
    for seed in (0, 1, 2):
        r = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Answer,
                                          seed=seed, max_tokens=64)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Answer)
        assert 0 <= parsed.digit <= 9 and parsed.sign in ("plus", "minus")


def test_streamed_json_is_the_non_streamed_text(client, closers):
    kw = dict(model="tiny", messages=ASK, response_format=JSON_OBJECT, seed=5, max_tokens=96,
              logit_bias=closers)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    assert isinstance(json.loads(whole), dict)


@pytest.mark.parametrize(("response_format", "extra", "fragment"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, {},
     "not a usable JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, {}, "'name'"),
    ({"type": "yaml"}, {}, "'yaml' is not supported"),
    (JSON_OBJECT, {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "cannot be combined with tools"),
])
def test_bad_response_formats_get_a_400_naming_the_field(client, response_format, extra,
                                                         fragment):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                       response_format=response_format, **extra)
    error = err.value.body
    assert error["param"] == "response_format", error
    assert fragment in error["message"], error["message"]


def test_json_object_with_tool_choice_none_is_served(client, closers):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, response_format=JSON_OBJECT, seed=3, max_tokens=96,
        logit_bias=closers, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f"}}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_compile_rejects_what_llguidance_cannot_build(policy):
    grammars = JsonGrammars(policy.tok, policy.tok.eos_token_id)
    with pytest.raises(GrammarError, match="does not exist"):
        grammars.compile({"$ref": "#/missing"})


@pytest.mark.parametrize("options", [None, EngineOptions(ngram_draft=2)],
                         ids=["static", "speculative"])
def test_the_other_engines_apply_the_mask_too(policy, options):
    """The merging `Batcher` and the speculative one (which hands constrained requests to the
    plain sampler) both yield schema-valid JSON for every row."""
    # closed, as the openai client's `parse` sends it: no keys beyond the two
    schema = {**Answer.model_json_schema(), "additionalProperties": False}
    grammar = JsonGrammars(policy.tok, policy.tok.eos_token_id).compile(schema)
    batcher = (Batcher(policy, max_rows=8) if options is None
               else make_batcher(policy, 8, options))
    try:
        [samples] = batcher.submit(["Give me JSON."], 3,
                                   SamplingParams(1.0, 1.0, 64, constraint=grammar),
                                   seed=1).result(60)
    finally:
        batcher.close()
    for s in samples:
        assert s.finish_reason == "stop" and s.eos, s.text
        Answer.model_validate_json(s.text)


class _Only:
    """A constraint admitting a fixed set of tokens, to check `constrain` by hand."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def allowed(self, vocab: int) -> torch.Tensor:
        out = torch.zeros(vocab, dtype=torch.bool)
        out[self.ids] = True
        return out

    def advance(self, token: int) -> None:
        self.ids = [token]


def test_constrain_sets_each_rows_disallowed_tokens_to_minus_infinity():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = constrain(logits, [_Only([0, 2]), _Only([1])])
    inf = float("-inf")
    assert out.tolist() == [[1.0, inf, 3.0], [inf, 5.0, inf]]
