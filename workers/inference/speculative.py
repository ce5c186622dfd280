"""Speculative decoding for the served policy: a cheap proposer guesses the next K tokens, the
target model scores all of them in one forward, and a rule keeps a prefix of the guesses so the
output has exactly the target's distribution (Leviathan et al. 2023, Chen et al. 2023).

Why: a decode step of a small model is dominated by per-forward overhead (and on GPUs by weight
reads), so scoring K+1 positions costs about what scoring one does; every accepted guess is a
token gained for free.

Parts, from pure to stateful:
- `accept_sampled` / `accept_greedy`: the acceptance rule over given distributions (pure).
- `prompt_lookup`: the n-gram proposer (find the last n tokens earlier in the context and
  propose what followed them; pure). `NgramProposer` wraps it.
- `DraftModel`: a small Hugging Face causal LM sharing the target's tokenizer, proposing with
  its own KV cache.
- `SpeculativeDecoder`: one sequence at a time through the target's forward with a
  `DynamicCache`, rejected positions rolled back (`roll_back`).

Sampling follows the server's order (temperature, top-k, top-p, min-p): p and q are the target's
and the draft's distributions after those filters, so the kept tokens follow the filtered target
distribution, as plain sampling does. Logprobs reported are the target's, as plain decoding
reports them. A repetition penalty makes p depend on the guesses themselves; such requests take
the plain path (see `SpeculativeBatcher` in engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from workers.rl.model import check_model_dir
from workers.rl.rollout import cut_at_stop, min_p_filter, top_k_filter, top_p_filter
from workers.rl.tokenizer import load_tokenizer


def roll_back(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of a KV cache (transformers 5.x `crop` takes the
    number of positions to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# ---- the acceptance rule (pure) ------------------------------------------------------------


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last axis: where to sample after a rejection. When p
    equals q the rejection cannot happen; p is returned so the result is always a
    distribution."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_sampled(draft: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                   gen: torch.Generator) -> tuple[list[int], int]:
    """Speculative sampling of one step.

    draft: the K proposed tokens; q (K,V): the draft's distribution at each; p (K+1,V): the
    target's distribution after the context and after each draft prefix (row K follows all K).
    Token i is kept with probability min(1, p_i(x)/q_i(x)); the first rejected position is
    resampled from residual(p_i, q_i); when all K are kept a bonus token is drawn from p_K.
    Returns (the tokens to append: kept drafts then one more, how many drafts were kept).
    One uniform is drawn per examined draft, then one sample, all from `gen`.
    """
    k = len(draft)
    if q.shape[0] != k or p.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need q of {k} rows and p of {k + 1}; got "
                         f"{q.shape[0]} and {p.shape[0]}")
    out: list[int] = []
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=gen))
        if qx > 0 and u < min(1.0, px / qx):
            out.append(int(x))
            continue
        r = residual(p[i], q[i])
        out.append(int(torch.multinomial(r, 1, generator=gen)))
        return out, i
    out.append(int(torch.multinomial(p[k], 1, generator=gen)))
    return out, k


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """Greedy (temperature 0) speculation: keep drafts while they equal the target's argmax;
    the first mismatch is replaced by the target's choice, and when all K match the target's
    next argmax follows. target_argmax has K+1 entries. Returns (tokens, drafts kept)."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafts need {len(draft) + 1} target choices; got "
                         f"{len(target_argmax)}")
    out: list[int] = []
    for i, x in enumerate(draft):
        if int(x) != int(target_argmax[i]):
            out.append(int(target_argmax[i]))
            return out, i
        out.append(int(x))
    out.append(int(target_argmax[len(draft)]))
    return out, len(draft)


# ---- proposers -----------------------------------------------------------------------------


def prompt_lookup(context: Sequence[int], n: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the context's last n tokens
    (prompt lookup decoding): the most recent occurrence followed by k tokens, else the one
    followed by the most (the earliest: in a repeating tail the latest match sits just behind
    the tail and leaves few tokens to propose). [] when the context is shorter than n+1 or the
    n-gram occurs nowhere earlier."""
    if n < 1 or k < 1:
        raise ValueError("n and k must be >= 1")
    size = len(context)
    if size <= n:
        return []
    tail = list(context[size - n:])
    best: list[int] = []
    for start in range(size - n - 1, -1, -1):  # most recent first, never the tail itself
        if list(context[start:start + n]) == tail:
            best = [int(t) for t in context[start + n:start + n + k]]
            if len(best) == k:
                break
    return best


class Filter(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...


class Proposer(Protocol):
    """Proposes up to k tokens after a context; `q` is None for a deterministic proposer."""

    def propose(self, context: list[int], k: int, dist: Filter, greedy: bool,
                gen: torch.Generator) -> tuple[list[int], torch.Tensor | None]: ...

    def commit(self, context: list[int], proposed: int, kept: int) -> None: ...

    def reset(self) -> None: ...


class NgramProposer:
    """Prompt lookup: free to run, deterministic (q is one-hot at its guess)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"the n-gram length must be >= 1; got {n}")
        self.n = n

    def propose(self, context: list[int], k: int, dist: Filter, greedy: bool,
                gen: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
        return prompt_lookup(context, self.n, k), None

    def commit(self, context: list[int], proposed: int, kept: int) -> None:
        pass

    def reset(self) -> None:
        pass


class DraftModelError(ValueError):
    """A draft checkpoint that cannot propose for this target."""


class DraftModel:
    """A small causal LM proposing tokens autoregressively from its own KV cache. Its
    tokenizer must be the target's (same vocabulary, same ids), checked at load."""

    def __init__(self, model_dir: str | Path, target_tokenizer: Any, target_vocab: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        path = check_model_dir(model_dir)
        tok = load_tokenizer(path)
        if tok.get_vocab() != target_tokenizer.get_vocab():
            mine, theirs = tok.get_vocab(), target_tokenizer.get_vocab()
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise DraftModelError(
                f"the draft checkpoint {path} does not share the served model's tokenizer "
                f"({len(mine)} vs {len(theirs)} tokens; e.g. {differ}): a draft must come from "
                "the same tokenizer (e.g. a smaller model of the same family)")
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model = model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.vocab = target_vocab
        self.device = device
        self.cache: DynamicCache | None = None
        self.cached = 0  # context tokens whose keys are in the cache

    def reset(self) -> None:
        self.cache, self.cached = DynamicCache(), 0

    def _next_logits(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=self.cache, use_cache=True)
        logits = out.logits[0, -1].float().cpu()  # (V_draft,)
        v = self.vocab
        if logits.shape[0] >= v:
            return logits[:v]
        pad = torch.full((v - logits.shape[0],), float("-inf"))
        return torch.cat([logits, pad])

    def propose(self, context: list[int], k: int, dist: Filter, greedy: bool,
                gen: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
        if self.cache is None:
            self.reset()
        feed = context[self.cached:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for step in range(k):
            logits = self._next_logits(feed)
            if step == 0:
                self.cached = len(context)
            else:
                self.cached += 1
            if greedy:
                x = int(logits.argmax())
            else:
                q = dist(logits[None])[0]
                qs.append(q)
                x = int(torch.multinomial(q, 1, generator=gen))
            tokens.append(x)
            feed = [x]
        # The cache now holds the context and all guesses but the last (`cached` counts them).
        return tokens, (torch.stack(qs) if qs else None)

    def commit(self, context: list[int], proposed: int, kept: int) -> None:
        """Drop the keys of rejected guesses: `context` is what it was at `propose`."""
        if self.cache is None:
            return
        valid = len(context) + min(kept, proposed - 1)
        if self.cached > valid:
            roll_back(self.cache, valid)
            self.cached = valid


# ---- the decoding loop ---------------------------------------------------------------------


@dataclass
class Generated:
    """One finished sequence: the tokens and, per token, the target's logprob and top
    alternatives (when asked)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    hit_stop: bool


def sampling_filter(temperature: float, top_k: int, top_p: float, min_p: float) -> Filter:
    """The server's sampling distribution from raw logits (N,V): softmax(logits / T), then
    top-k, top-p and min-p (as continuous.py's `_draw`), normalised."""

    def dist(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits / temperature, dim=-1)
        probs = top_k_filter(probs, top_k)
        probs = top_p_filter(probs, top_p)
        probs = min_p_filter(probs, min_p)
        return probs / probs.sum(-1, keepdim=True)

    return dist


class SpeculativeDecoder:
    """Generates one sequence at a time with a proposer and the target's KV cache."""

    def __init__(self, model: torch.nn.Module, proposer: Proposer, k: int, eos: int | None,
                 decode: Callable[[list[int]], str]) -> None:
        if k < 1:
            raise ValueError(f"the number of speculative tokens must be >= 1; got {k}")
        self.model, self.proposer, self.k, self.eos = model, proposer, k, eos
        self.decode_text = decode
        self.device = next(model.parameters()).device
        self.proposed = 0  # guesses scored by the target
        self.accepted = 0  # guesses kept
        self.steps = 0  # target forwards after the prompt

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def _forward(self, ids: list[int], cache: DynamicCache) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True)
        return out.logits[0].float().cpu()  # (T,V)

    @torch.no_grad()
    def generate(self, prompt: list[int], *, max_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 stop: Sequence[str] = (), top_logprobs: int = 0,
                 gen: torch.Generator | None = None, context_limit: int | None = None,
                 on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None
                 ) -> Generated:
        """Up to max_tokens tokens after prompt (ids); temperature 0 is greedy. Ends at the
        eos, a stop string, max_tokens or the context limit."""
        if not prompt:
            raise ValueError("a prompt must hold at least one token")
        gen = gen if gen is not None else torch.Generator()
        greedy = temperature == 0.0
        scale = 1.0 if greedy else temperature
        dist = sampling_filter(scale, top_k, top_p, min_p)
        stops = [s for s in stop if s]
        limit = max_tokens
        if context_limit is not None:
            limit = min(limit, context_limit - len(prompt))
        cache = DynamicCache()
        self.proposer.reset()
        if len(prompt) > 1:  # invariant: the cache holds every context token but the last
            self._forward(prompt[:-1], cache)
        context = list(prompt)
        res = Generated([], [], [], False)
        while len(res.token_ids) < limit:
            room = limit - len(res.token_ids) - 1  # the step always adds one token of its own
            drafts: list[int] = []
            q: torch.Tensor | None = None
            if room > 0:
                drafts, q = self.proposer.propose(context, min(self.k, room), dist, greedy, gen)
            logits = self._forward([context[-1]] + drafts, cache)  # (K+1,V)
            self.steps += 1
            if greedy:
                new, kept = accept_greedy(drafts, logits.argmax(-1).tolist())
            else:
                p = dist(logits)
                if q is None:  # a deterministic guess: q is one-hot at it
                    q = torch.zeros((len(drafts), p.shape[-1]))
                    if drafts:
                        q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
                new, kept = accept_sampled(drafts, q, p, gen)
            self.proposed += len(drafts)
            self.accepted += kept
            self.proposer.commit(context, len(drafts), kept)
            roll_back(cache, len(context) + kept)  # keys of the last token and of the kept drafts
            logp = torch.log_softmax(logits[: len(new)] / scale, dim=-1)
            done = False
            for i, t in enumerate(new):
                context.append(t)
                lp = float(logp[i, t])
                alts: list[tuple[int, float]] = []
                if top_logprobs:
                    vals, idx = logp[i].topk(top_logprobs)
                    alts = list(zip(idx.tolist(), vals.tolist(), strict=True))
                    res.top_logprobs.append(alts)
                res.token_ids.append(t)
                res.logprobs.append(lp)
                if on_token is not None:
                    on_token(t, lp, alts)
                if stops and t != self.eos:
                    res.hit_stop = cut_at_stop(self.decode_text(res.token_ids), stops)[1]
                if t == self.eos or res.hit_stop or len(res.token_ids) >= limit:
                    done = True
                    break
            if done:
                break
        return res
