"""Constrained-decoding libraries side by side: why the policy server uses llguidance.

Issue 23 item 3 asks to measure xgrammar, llguidance, outlines and lm-format-enforcer and choose.
Each library gets the same byte-level BPE tokenizer (trained here on generated text, ~32k
tokens: no downloads), the same JSON schemas and the same token sequences (a valid document per
schema, tokenised). Per library and schema: the compile time (schema -> a matcher ready for the
first mask, tokenizer set-up excluded and timed once apart) and the time to compute the
next-token mask over the whole vocabulary at every step of the document, then advance by the
document's token. `crucible` is the server's own path (`workers.inference.grammar.JsonMatcher`:
llguidance plus the conversion to a torch bool mask the samplers use); the raw libraries follow.

Every library must agree that each document token is allowed at its step (a library that
rejects a valid document is reported, not timed). One thread throughout.

    make bench-grammar
    .venv/bin/python -m tests.benchmarks.bench_grammar [--vocab 32000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "score": {"type": "number"}, "active": {"type": "boolean"}},
        "required": ["name", "age", "score", "active"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["open", "closed", "pending"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
            "owner": {"type": "object",
                      "properties": {"login": {"type": "string"}, "admin": {"type": "boolean"}},
                      "required": ["login", "admin"], "additionalProperties": False},
            "events": {"type": "array", "items": {
                "type": "object",
                "properties": {"kind": {"type": "string"}, "at": {"type": "integer"}},
                "required": ["kind", "at"], "additionalProperties": False}},
        },
        "required": ["id", "status", "tags", "owner", "events"], "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["shell", "read_file", "write_file", "run_tests"]},
            "arguments": {"type": "object",
                          "properties": {"path": {"type": "string"},
                                         "content": {"type": "string"}},
                          "required": ["path", "content"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    },
}

DOCUMENTS: dict[str, dict[str, Any]] = {
    "flat": {"name": "Ada Lovelace", "age": 36, "score": 97.25, "active": True},
    "nested": {"id": 4182, "status": "pending", "tags": ["moe", "rl", "grpo", "router"],
               "owner": {"login": "mlops-team", "admin": False},
               "events": [{"kind": "opened", "at": 1733400000},
                          {"kind": "labelled", "at": 1733400123},
                          {"kind": "assigned", "at": 1733409999}]},
    "tool_call": {"name": "write_file",
                  "arguments": {"path": "src/answer.txt",
                                "content": "The total of column B is 1234.5; rows 3 and 7 "
                                           "were skipped because their cells are empty."}},
}

_WORD_TEXT = """the of and to in is for on with as by at from that this be are was it or an
model expert router token reward policy sample value score total file path name status event
kind owner admin login tags open closed pending shell read write run tests answer column rows
cells empty skipped because content arguments active age team run step loss train eval batch
group layer shard rank node queue worker"""
WORDS = _WORD_TEXT.split()


def corpus(n: int, seed: int = 0) -> Iterator[str]:
    """Generated English-like lines and JSON documents, so merges cover both words and JSON
    punctuation (`": "`, `", "`, `{"`) as a real LLM vocabulary does."""
    rng = random.Random(seed)
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        if i % 3 == 0:
            doc = {rng.choice(WORDS): rng.choice([rng.randint(0, 99999), " ".join(words[:3]),
                                                  rng.random() > 0.5, round(rng.random(), 3)])
                   for _ in range(rng.randint(1, 5))}
            yield json.dumps(doc, separators=(",", ":"))
        else:
            line = " ".join(words)
            yield line.capitalize() + rng.choice([".", "?", "!", ":", ";"]) + \
                f" {rng.randint(0, 10 ** rng.randint(1, 6))}"


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with GPT-2's pre-tokenising regex (`use_regex=True`), like the Qwen and
    Llama tokenizers the libraries are written for."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(120_000), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


@dataclass
class Result:
    compile_s: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)   # per token, one entry per repeat
    error: str = ""


class Library(ABC):
    """One library's harness: `setup` once per tokenizer, `compile(schema)` -> a stepper whose
    `mask()` computes the next-token mask and returns whether `token` is allowed, and
    `advance(token)` consumes it."""

    name = ""
    modules: tuple[str, ...] = ()

    def load(self) -> None:
        """Import the library untimed (first imports cost seconds that a server pays once)."""
        for module in self.modules:
            importlib.import_module(module)

    @abstractmethod
    def setup(self, tok: PreTrainedTokenizerFast, eos: int) -> None:
        """Build the library's tokenizer data (timed once, apart from compiles)."""

    @abstractmethod
    def compile(self, schema: dict[str, Any]) -> Any:
        """A stepper for one document under `schema` (timed as the compile)."""


class Crucible(Library):
    name = "crucible"
    modules = ("workers.inference.grammar",)

    def setup(self, tok, eos):
        from workers.inference.grammar import JsonGrammars
        self.grammars = JsonGrammars(tok, eos)
        self.vocab = len(tok)

    def compile(self, schema):
        grammar = self.grammars.compile(schema)
        matcher = grammar()
        vocab = self.vocab

        class Step:
            def allowed(self, token: int) -> bool:
                return bool(matcher.allowed(vocab)[token])

            def advance(self, token: int) -> None:
                matcher.advance(token)
        return Step()


class LLGuidance(Library):
    """llguidance itself through its bitmask API (what `crucible` is built on)."""

    name = "llguidance"
    modules = ("workers.inference.grammar", "llguidance.torch")

    def setup(self, tok, eos):
        from workers.inference.grammar import JsonGrammars
        self.grammars = JsonGrammars(tok, eos)
        self.vocab = len(tok)

    def compile(self, schema):
        import llguidance
        import llguidance.torch as lt
        grammar = self.grammars.compile(schema)
        matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        bitmask = lt.allocate_token_bitmask(1, self.vocab)

        class Step:
            def allowed(self, token: int) -> bool:
                lt.fill_next_token_bitmask(matcher, bitmask, 0)
                return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

            def advance(self, token: int) -> None:
                matcher.consume_token(token)
        return Step()


class XGrammar(Library):
    name = "xgrammar"
    modules = ("xgrammar",)

    def setup(self, tok, eos):
        import xgrammar as xgr
        self.xgr = xgr
        # The exact bytes of every token (`from_huggingface` guesses the vocabulary's encoding
        # from the tokenizer's class and refused JSON punctuation with this trained one).
        info = xgr.TokenizerInfo(token_bytes(tok), xgr.VocabType.RAW, vocab_size=len(tok),
                                 stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = len(tok)

    def compile(self, schema):
        xgr = self.xgr
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(",", ":"), strict_mode=True)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)

        class Step:
            def allowed(self, token: int) -> bool:
                matcher.fill_next_token_bitmask(bitmask)
                return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

            def advance(self, token: int) -> None:
                if not matcher.accept_token(token):
                    raise AssertionError(f"xgrammar refused token {token}")
        return Step()


class OutlinesCore(Library):
    name = "outlines_core"
    modules = ("outlines_core", "outlines_core.json_schema")

    def setup(self, tok, eos):
        from outlines_core import Vocabulary
        mapping: dict[bytes, list[int]] = {}
        for tid, raw in enumerate(token_bytes(tok)):
            if tid != eos:
                mapping.setdefault(raw, []).append(tid)
        self.vocabulary = Vocabulary(eos, mapping)
        self.vocab = len(tok)

    def compile(self, schema):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        guide = Guide(Index(regex, self.vocabulary))
        mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)

        class Step:
            def allowed(self, token: int) -> bool:
                guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
                return bool((int(mask[token // 32]) >> (token % 32)) & 1)

            def advance(self, token: int) -> None:
                guide.advance(token)
        return Step()


class LmFormatEnforcer(Library):
    name = "lm_format_enforcer"
    modules = ("lmformatenforcer",)

    def setup(self, tok, eos):
        # Its transformers integration imports a module transformers 5 no longer has, so the
        # tokenizer data is built here as that integration does: (id, text, starts a word).
        from lmformatenforcer import TokenEnforcerTokenizerData
        regular = [(tid, raw.decode("utf-8", "replace"), raw.startswith(b" "))
                   for tid, raw in enumerate(token_bytes(tok)) if tid != eos]
        self.data = TokenEnforcerTokenizerData(regular, tok.decode, eos, False, len(tok))

    def compile(self, schema):
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer
        enforcer = TokenEnforcer(self.data, JsonSchemaParser(schema))
        prefix: list[int] = []

        class Step:
            def allowed(self, token: int) -> bool:
                return token in enforcer.get_allowed_tokens(prefix).allowed_tokens

            def advance(self, token: int) -> None:
                prefix.append(token)
        return Step()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


BYTE_DECODER = _byte_decoder()


def token_bytes(tok: PreTrainedTokenizerFast) -> list[bytes]:
    """Each token id's exact bytes (byte-level alphabet decoded; special tokens as their text)."""
    out = [b""] * len(tok)
    special = set(tok.all_special_tokens)
    for text, tid in tok.get_vocab().items():
        out[tid] = text.encode() if text in special else bytes(BYTE_DECODER[c] for c in text)
    return out


LIBRARIES: list[Callable[[], Library]] = [Crucible, LLGuidance, XGrammar, OutlinesCore,
                                          LmFormatEnforcer]


def measure(lib: Library, schema: dict[str, Any], tokens: list[int], repeats: int,
            result: Result) -> None:
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = lib.compile(schema)
        t1 = time.perf_counter()
        for i, token in enumerate(tokens):
            if not step.allowed(token):
                raise AssertionError(f"refused token {i} of a valid document")
            step.advance(token)
        t2 = time.perf_counter()
        result.compile_s.append(t1 - t0)
        result.mask_us.append((t2 - t1) / len(tokens) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated library names")
    args = parser.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    tok = train_tokenizer(args.vocab)
    eos = tok.eos_token_id
    print(f"tokenizer: {len(tok)} tokens, byte-level BPE, trained in "
          f"{time.perf_counter() - t0:.1f} s; load average {os.getloadavg()[0]:.1f}")
    docs = {name: tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
            for name, doc in DOCUMENTS.items()}
    for name, ids in docs.items():
        print(f"  schema {name}: document of {len(ids)} tokens")

    wanted = {n for n in args.only.split(",") if n}
    results: dict[str, dict[str, Result]] = {}
    setup_s: dict[str, float] = {}
    for make in LIBRARIES:
        lib = make()
        if wanted and lib.name not in wanted:
            continue
        per_schema = results.setdefault(lib.name, {})
        try:
            lib.load()
            t = time.perf_counter()
            lib.setup(tok, eos)
            setup_s[lib.name] = time.perf_counter() - t
        except ImportError as exc:
            print(f"{lib.name}: not installed ({exc}); `make bench-grammar` installs it")
            continue
        for sname, schema in SCHEMAS.items():
            res = per_schema.setdefault(sname, Result())
            try:
                measure(lib, schema, docs[sname], args.repeats, res)
            except Exception as exc:  # a library that cannot do a schema is reported
                res.error = f"{type(exc).__name__}: {exc}"[:160]
            shown = res.error or (f"compile {statistics.median(res.compile_s) * 1e3:.1f} ms, "
                                  f"mask {statistics.median(res.mask_us):.1f} us/token")
            print(f"  {lib.name} {sname}: {shown}")

    print(f"\nload average {os.getloadavg()[0]:.1f}; medians of {args.repeats} repeats")
    ours = results.get("crucible", {})
    for lib_name, seconds in setup_s.items():
        print(f"grammar_tokenizer_setup_s {lib_name}: {lib_name}={seconds:.2f}")
    for sname in SCHEMAS:
        mine = ours.get(sname)
        for lib_name, per_schema in results.items():
            if lib_name == "crucible" or sname not in per_schema:
                continue
            other = per_schema[sname]
            if other.error or not mine or mine.error:
                print(f"grammar_mask_us_per_token {sname}: {lib_name}=failed "
                      f"({other.error or mine.error if mine else 'no crucible figure'})")
                continue
            for figure, a, b in (("grammar_mask_us_per_token", mine.mask_us, other.mask_us),
                                 ("grammar_compile_ms", mine.compile_s, other.compile_s)):
                scale = 1e3 if figure == "grammar_compile_ms" else 1.0
                ma, mb = statistics.median(a) * scale, statistics.median(b) * scale
                print(f"{figure} {sname} vs {lib_name}: crucible={ma:.1f} {lib_name}={mb:.1f} "
                      f"ratio={ma / mb:.2f} target=<=1")


if __name__ == "__main__":
    main()
