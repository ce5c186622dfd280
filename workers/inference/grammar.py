"""Structured output (`response_format` json_object / json_schema) by constrained decoding.

llguidance (Rust) compiles a JSON schema to a grammar and, each decode step, computes which
tokens of the vocabulary can continue a string the grammar accepts; the samplers set the others
to -inf (`workers.rl.rollout.constrain`). EOS is admitted only once the grammar accepts, so a
finished completion always parses. Requests without a `response_format` never build a matcher.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON: with flexible whitespace a weak model can spend its whole budget on blanks.
COMPILE_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema llguidance cannot compile: the message says why."""


class JsonMatcher:
    """One row's grammar state: the tokens allowed next, advanced by each sampled token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, eos: int) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.eos = eos
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def allowed(self, vocab: int) -> torch.Tensor:
        """(vocab,) bool. A matcher that has stopped (or failed) admits only EOS, so a row that
        is already done still has a finite logit to sample from. Read through llguidance's
        bitmask (bit i of 32-bit word w is token 32w+i, little-endian) unpacked by numpy:
        `make bench-grammar` measured `compute_logit_bias` (a byte a token, then compared)
        at 3-5x llguidance's own mask time, this at about 1.5x (docs/serving.md)."""
        m = self.matcher
        if m.is_error() or m.is_stopped():
            bits = np.zeros(vocab, np.uint8)
        else:
            llguidance.torch.fill_next_token_bitmask(m, self.bitmask, 0)
            bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), bitorder="little")
            if bits.shape[0] < vocab:
                bits = np.concatenate([bits, np.zeros(vocab - bits.shape[0], np.uint8)])
            bits = bits[:vocab]
        if not bits.any():  # numpy's any: torch's on a 32k bool tensor took 66 us here
            bits[self.eos] = 1
        return torch.from_numpy(bits).view(torch.bool)

    def advance(self, token: int) -> None:
        if not (self.matcher.is_error() or self.matcher.is_stopped()):
            self.matcher.consume_token(token)

    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class Grammar:
    """A compiled grammar; calling it starts a fresh matcher for one row. Compared by identity,
    so two requests with their own grammars never merge into one batch by accident."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str, eos: int) -> None:
        self.tokenizer, self.text, self.eos = tokenizer, text, eos

    def __call__(self) -> JsonMatcher:
        return JsonMatcher(self.tokenizer, self.text, self.eos)


class JsonGrammars:
    """Compiles JSON schemas for one HF tokenizer. The llguidance tokenizer is built once:
    it walks the whole vocabulary."""

    def __init__(self, tok: Any, eos: int) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos)
        self.eos = eos

    def compile(self, schema: dict[str, Any]) -> Grammar:
        """The grammar of JSON values valid under `schema`; GrammarError when it is not a
        schema llguidance supports."""
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults=COMPILE_OPTIONS)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text,
                                                                               self.tokenizer)
        if failed:
            raise GrammarError(messages[0] if messages else "the schema does not compile")
        return Grammar(self.tokenizer, text, self.eos)
