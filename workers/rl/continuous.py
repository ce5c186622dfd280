"""Continuous batching: requests join and leave a running batch between decode steps, a shared
prompt is prefilled once, cached prefixes are reused, long prompts prefill in chunks between
decode steps. One scheduler serves both the OpenAI-compatible endpoint (`workers.inference`
wraps it as `ContinuousBatcher`) and the RL engine's training rollouts (`ContinuousRollout`,
`rollout.engine = "continuous"`), so a trained policy is sampled the same way in both.

Why hand-written and not transformers' own `ContinuousBatchingManager` (transformers 5.24,
`generate_batch`): that manager takes one generation config for the whole manager, not per
request, samples with its own logits processors and has no hook for the per-token logprobs of
the distribution the RL engine samples from (`workers.rl.rollout`'s order: penalty, temperature,
top-k, top-p, min-p), seeded per request, nor for the experts each token was routed to (router
replay). Completions must be scored exactly as training scores them, so the scheduler reuses
the RL engine's lean Qwen3-MoE forward (`workers.rl.lean`: the policy's own fused weights and
experts) and its sampling filters.

Layout. Every running sequence owns a *slot*: rows 0..B-1 of per-layer K/V buffers
(slots, kv_heads, length, head_dim), a sequence's keys at positions 0..len-1 of its row. A decode
step feeds each running row its last sampled token at its own position (rows may be at different
lengths; each attends to its own prefix through an additive mask), samples, and drops finished
rows by moving the last row into the freed slot, so running rows stay packed at 0..B-1 and the
attention reads a view, never a gather.

A new prompt prefills into a one-row staging buffer, at most `prefill_chunk` tokens per
scheduler iteration (the rest waits for the next iteration, after a decode step of the running
rows: a long prompt does not stall the others). When it is complete, its first tokens are sampled
from the prompt's logits and its keys are copied into one slot per sample: a GRPO group of n
samples (or a request's n) prefills its prompt once.

Prefix cache. Finished prompts (and, for single-sample requests, prompt + completion: the next
chat turn, or the next turn of a multi-turn episode, starts with them) are kept, up to
`prefix_cache_tokens`, indexed by their token prefixes at multiples of `PREFIX_BLOCK` tokens and
at their full length. A new prompt copies the longest cached prefix into staging and prefills
only the rest. Cached keys belong to the weights that computed them: `refresh` (a training step
changed the weights) rebuilds the fused weights and empties the cache.
"""

from __future__ import annotations

import copy
import secrets
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from workers.rl.lean import LeanQwen3Moe, supported
from workers.rl.rollout import (
    HFRollout,
    Prompt,
    RolloutBatch,
    SamplingControls,
    StepHook,
    TokenConstraint,
    constrain,
    cut_at_stop,
    left_pad,
    logit_bias,
    min_p_filter,
    repetition_penalty,
    top_k_filter,
    top_p_filter,
)
from workers.rl.routing import NO_ROUTE
from workers.rl.sampling import Job, JobInbox, Sample, SamplingParams, TokenEvent
from workers.rl.spec import RolloutSpec

PREFIX_BLOCK = 16  # cached prefixes are matched at multiples of this many tokens
START_LENGTH = 256  # K/V buffers start this long and double on demand (up to the context)


class SlotCache:
    """Per-slot K/V buffers and the forwards that read and write them (no autograd)."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int, *,
                 record_routes: bool = False) -> None:
        self.model = model
        self.lean = LeanQwen3Moe(model, 0, max_len)  # fused weights, RoPE tables, experts
        self.max_len, self.slots = max_len, slots
        self.record_routes = record_routes
        self.routes: torch.Tensor | None = None  # the last forward's ((N*T),L,k), if recorded
        lean = self.lean
        self.h, self.kv, self.hd = lean.n_heads, lean.n_kv, lean.head_dim
        weight = lean.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.length = min(START_LENGTH, max_len)
        n_layers = len(lean.layers)
        self.keys = [self._buf(slots, self.length) for _ in range(n_layers)]
        self.values = [self._buf(slots, self.length) for _ in range(n_layers)]
        self.stage_k = [self._buf(1, self.length) for _ in range(n_layers)]
        self.stage_v = [self._buf(1, self.length) for _ in range(n_layers)]

    def _buf(self, rows: int, length: int) -> torch.Tensor:
        return torch.zeros((rows, self.kv, length, self.hd), dtype=self.dtype, device=self.device)

    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters (the lean forward
        reads the rest, norms, router and experts, straight from the model)."""
        self.lean = LeanQwen3Moe(self.model, 0, self.max_len)

    def reserve(self, length: int) -> None:
        """Make the buffers hold `length` positions (doubling, capped at the context)."""
        if length <= self.length:
            return
        new = self.length
        while new < length:
            new *= 2
        new = min(new, self.max_len)

        def grow(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
            out = []
            for b in bufs:
                g = torch.zeros((b.shape[0], self.kv, new, self.hd), dtype=self.dtype,
                                device=self.device)
                g[:, :, : self.length] = b
                out.append(g)
            return out

        self.keys, self.values = grow(self.keys), grow(self.values)
        self.stage_k, self.stage_v = grow(self.stage_k), grow(self.stage_v)
        self.length = new

    # ---- the forward ---------------------------------------------------------------------

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   write: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                   bias: torch.Tensor) -> torch.Tensor:
        """Layer i's attention as `LeanQwen3Moe.attention` computes it; `write(k, v)` stores
        the new keys/values and returns the keys/values to attend to (N,KV,S,hd)."""
        lean, h, kv, hd = self.lean, self.h, self.kv, self.hd
        n, t, _ = x.shape
        g = h // kv
        qkv = F.linear(x, lean.qkv[i]).view(n, t, h + 2 * kv, hd)
        qk = F.rms_norm(qkv[:, :, : h + kv], (hd,), None, lean.eps) * lean.qk_scale[i]
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # RoPE, (N,T,H+KV,hd)
        q = qk[:, :, :h].transpose(1, 2)  # (N,H,T,hd)
        k = qk[:, :, h:].transpose(1, 2)  # (N,KV,T,hd)
        v = qkv[:, :, h + kv :].transpose(1, 2)
        keys, values = write(k, v)
        q = q.reshape(n, kv, g * t, hd)  # query head j reads key head j // g
        scores = torch.matmul(q, keys.transpose(-1, -2))  # (N,KV,g*T,S)
        scores = (scores.view(n, kv, g, t, -1) + bias).softmax(-1)
        out = torch.matmul(scores.view(n, kv, g * t, -1), values)  # (N,KV,g*T,hd)
        out = out.view(n, h, t, hd).transpose(1, 2).reshape(n, t, h * hd)
        return F.linear(out, lean.o[i])

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor,
                 writer: Callable[[int], Callable[[torch.Tensor, torch.Tensor],
                                                  tuple[torch.Tensor, torch.Tensor]]]
                 ) -> torch.Tensor:
        """Logits (N,V) at the last position of ids (N,T) at positions pos (N,T)."""
        lean = self.lean
        x = lean.embed(ids)
        cos = lean.cos[pos].unsqueeze(2)  # (N,T,1,hd)
        sin = lean.sin[pos].unsqueeze(2)
        for i, layer in enumerate(lean.layers):
            x = x + self._attention(i, lean.rms(x, layer.input_layernorm), cos, sin,
                                    writer(i), bias)
            x = x + lean.moe(layer, lean.rms(x, layer.post_attention_layernorm), None, i)
        if self.record_routes:
            self.routes = lean.take_routes()
        lean.used = []
        return lean.lm_head(lean.rms(x[:, -1], lean.norm))

    def prefill(self, ids: list[int], start: int) -> torch.Tensor:
        """Feed ids at positions start.. into the staging row, whose positions 0..start-1
        already hold keys. Returns the last position's logits (1,V)."""
        t = len(ids)
        end = start + t
        self.reserve(end)
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        cols = torch.arange(end, device=self.device)
        allowed = cols[None, :] <= pos[0][:, None]  # (T,S) causal over the whole prefix
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~allowed, self.lean.neg)

        def writer(i: int) -> Callable[[torch.Tensor, torch.Tensor],
                                       tuple[torch.Tensor, torch.Tensor]]:
            def write(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.stage_k[i][:, :, start:end] = k
                self.stage_v[i][:, :, start:end] = v
                return self.stage_k[i][:, :, :end], self.stage_v[i][:, :, :end]
            return write

        return self._forward(tokens, pos, bias.view(1, 1, 1, t, end), writer)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token per running row: tokens (B,) at positions pos (B,) of slots 0..B-1, each
        attending to its own positions 0..pos. Returns logits (B,V)."""
        b = tokens.shape[0]
        span = int(pos.max()) + 1
        self.reserve(span)
        rows = torch.arange(b, device=self.device)
        cols = torch.arange(span, device=self.device)
        bias = torch.zeros((b, span), dtype=self.dtype, device=self.device)
        bias.masked_fill_(cols[None, :] > pos[:, None], self.lean.neg)

        def writer(i: int) -> Callable[[torch.Tensor, torch.Tensor],
                                       tuple[torch.Tensor, torch.Tensor]]:
            def write(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.keys[i][rows, :, pos] = k[:, :, 0]
                self.values[i][rows, :, pos] = v[:, :, 0]
                return self.keys[i][:b, :, :span], self.values[i][:b, :, :span]
            return write

        return self._forward(tokens[:, None], pos[:, None], bias.view(b, 1, 1, 1, span), writer)

    # ---- moving keys between staging, slots and the prefix cache ----------------------------

    def stage_to_slots(self, slots: list[int], length: int) -> None:
        for i in range(len(self.keys)):
            self.keys[i][slots, :, :length] = self.stage_k[i][:, :, :length]
            self.values[i][slots, :, :length] = self.stage_v[i][:, :, :length]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for i in range(len(self.keys)):
            self.keys[i][dst, :, :length] = self.keys[i][src, :, :length]
            self.values[i][dst, :, :length] = self.values[i][src, :, :length]

    def export(self, slot: int | None, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of a slot's (None: staging's) first `length` keys/values, per layer."""
        ks, vs = (self.stage_k, self.stage_v) if slot is None else (self.keys, self.values)
        row = 0 if slot is None else slot
        return [(k[row, :, :length].clone(), v[row, :, :length].clone())
                for k, v in zip(ks, vs, strict=True)]

    def load_stage(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.reserve(length)
        for i, (k, v) in enumerate(kv):
            self.stage_k[i][0, :, :length] = k[:, :length]
            self.stage_v[i][0, :, :length] = v[:, :length]


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    keys: list[tuple[int, ...]] = field(default_factory=list)  # its index keys
    routes: torch.Tensor | None = None  # (len,L,k) experts per token, when recorded


class PrefixCache:
    """Keys/values of recent token sequences, looked up by the longest shared prefix."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order
        self.index: dict[tuple[int, ...], int] = {}
        self.tokens = 0
        self.hits = self.hit_tokens = self.lookups = 0
        self._next = 0

    def lookup(self, ids: list[int]) -> tuple[int, _Entry | None]:
        """The longest usable cached prefix of ids: (length, the entry holding it), at most
        len-1 tokens (the last prompt token is always fed, for its logits)."""
        self.lookups += 1
        n = len(ids)
        if not self.budget or n < 2:
            return 0, None
        lengths = [n] + list(range((n - 1) // PREFIX_BLOCK * PREFIX_BLOCK, 0, -PREFIX_BLOCK))
        for length in lengths:
            eid = self.index.get(tuple(ids[:length]))
            if eid is None:
                continue
            entry = self.entries[eid]
            self.entries.move_to_end(eid)
            use = min(length, n - 1)
            self.hits += 1
            self.hit_tokens += use
            return use, entry
        return 0, None

    def insert(self, ids: list[int], kv: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
               routes: torch.Tensor | None = None) -> None:
        """Remember ids' keys/values (`kv` builds the copies, only when they are kept) and,
        when recorded, their tokens' routes."""
        n = len(ids)
        if not self.budget or n < PREFIX_BLOCK or n > self.budget:
            return
        full = tuple(ids)
        if full in self.index:
            self.entries.move_to_end(self.index[full])
            return
        while self.tokens + n > self.budget and self.entries:
            self._evict()
        eid, self._next = self._next, self._next + 1
        entry = _Entry(full, kv(), routes=routes)
        keys = [full] + [full[:m] for m in range(PREFIX_BLOCK, n, PREFIX_BLOCK)]
        for key in keys:
            self.index[key] = eid  # the newest entry serves a shared prefix
        entry.keys = keys
        self.entries[eid] = entry
        self.tokens += n

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.tokens = 0

    def _evict(self) -> None:
        eid, entry = self.entries.popitem(last=False)
        self.tokens -= len(entry.tokens)
        for key in entry.keys:
            if self.index.get(key) == eid:
                del self.index[key]
        # A prefix another entry still holds stays findable through it.
        for other_id, other in self.entries.items():
            for key in entry.keys:
                if key not in self.index and other.tokens[: len(key)] == key:
                    self.index[key] = other_id
                    other.keys.append(key)  # so its own eviction drops the key too


@dataclass
class _Seq:
    """One sample being generated: a running row (slot) once its prompt is prefilled."""

    job: Job
    row: int  # the job's row: prompt-major, n samples per prompt
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    hit_stop: bool = False
    rule: TokenConstraint | None = None  # structured output: this row's grammar state
    prompt_routes: torch.Tensor | None = None  # (P,L,k), shared by the group, when recorded
    routes: list[torch.Tensor] = field(default_factory=list)  # (L,k) per token fed

    @property
    def length(self) -> int:
        """Positions whose keys are in the slot: the prompt and all but the last token."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class _Group:
    """A distinct prompt of a job and its n samples, waiting for or in prefill."""

    job: Job
    ids: list[int]
    seqs: list[_Seq]
    done: int = 0  # prompt tokens whose keys are in staging
    routes: list[torch.Tensor] = field(default_factory=list)  # (T,L,k) per chunk, recorded


@dataclass
class _JobState:
    generator: torch.Generator
    samples: list[Sample | None]
    left: int


class ContinuousScheduler(JobInbox):
    """The `Batcher` interface (`submit`, `close`, `batches`) over a continuous scheduler.

    `tok` is used on the scheduler's thread only (fast tokenizers refuse concurrent calls);
    `record_routes` keeps each token's experts per layer in its `Sample` (router replay and the
    mismatch metrics of training read them)."""

    def __init__(self, model: torch.nn.Module, tok: Any, context: int | None,
                 max_rows: int = 64, *, prefill_chunk: int = 512,
                 prefix_cache_tokens: int = 16384, prefix_caching: bool = True,
                 record_routes: bool = False) -> None:
        super().__init__()
        self.model, self.tok, self.max_rows = model, tok, max_rows
        self.max_n = max_rows  # a prompt's samples run side by side
        self.prefill_chunk = prefill_chunk
        context = context or 2048
        self.cache = SlotCache(model, max_rows, context, record_routes=record_routes)
        self.context = context
        self.record_routes = record_routes
        self.prefix = PrefixCache(prefix_cache_tokens if prefix_caching else 0)
        self.eos = tok.eos_token_id
        self._groups: deque[_Group] = deque()
        self._running: list[_Seq] = []
        self._state: dict[int, _JobState] = {}
        self.batches = 0  # decode steps run
        self.prefill_tokens = 0  # prompt tokens fed (cache hits are not)
        self.max_running = 0  # the most rows decoded together, for tests and logs
        self._thread = threading.Thread(target=self._loop, name="inference-scheduler",
                                        daemon=True)
        self._thread.start()

    # ---- the interface ---------------------------------------------------------------------

    def _check(self, n: int) -> None:
        if n > self.max_rows:
            raise ValueError(f"n={n} exceeds this server's batch of {self.max_rows} rows "
                             "(--max-batch)")

    # ---- the scheduler ---------------------------------------------------------------------

    def refresh(self, keep_prefixes: bool = False) -> None:
        """Rebuild the fused weights from the model's parameters (a training step changed
        them) and, unless the caller knows the weights are unchanged, drop the cached
        prefixes, whose keys older weights computed. Only between requests."""
        with self._cv:
            if self._jobs or self._groups or self._running:
                raise RuntimeError("refresh() while requests are in flight")
            self.cache.refresh()
            if not keep_prefixes:
                self.prefix.clear()

    def _loop(self) -> None:
        # The scheduler's forwards never build a graph, whatever the model's requires_grad
        # (a training model's parameters do); grad mode is per thread.
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._jobs or self._groups or self._running or self._closed):
                    self._cv.wait()
                if self._closed and not (self._jobs or self._groups or self._running):
                    return
                new = list(self._jobs)
                self._jobs.clear()
            for job in new:
                self._admit(job)
            try:
                self._prefill()
                if self._running:
                    self._decode()
            except Exception as exc:  # noqa: BLE001 - handed to every request in flight
                self._fail_all(exc)

    def _admit(self, job: Any) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            encoded = [self._encode(p) for p in job.prompts]
            if any(not ids for ids in encoded):
                raise ValueError("a prompt must hold at least one token")
        except Exception as exc:  # noqa: BLE001 - the request's own failure
            job.future.set_exception(exc)
            return
        gen = torch.Generator()
        gen.manual_seed(job.seed if job.seed is not None else secrets.randbits(62))
        self._state[id(job)] = _JobState(gen, [None] * job.rows, job.rows)
        for i, ids in enumerate(encoded):
            make = job.params.constraint
            seqs = [_Seq(job, i * job.n + j, ids, rule=make() if make else None)
                    for j in range(job.n)]
            self._groups.append(_Group(job, ids, seqs))

    def _encode(self, prompt: Prompt) -> list[int]:
        """Token ids with the scheduler's own tokenizer (request threads use another one)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return list(self.tok(prompt, add_special_tokens=False)["input_ids"])

    def _prefill(self) -> None:
        """Up to `prefill_chunk` prompt tokens of the waiting groups, in order; a group whose
        prompt is complete samples its first tokens and its rows join the running batch."""
        budget = self.prefill_chunk
        while self._groups and budget > 0:
            group = self._groups[0]
            if len(self._running) + len(group.seqs) > self.max_rows:
                return  # waits for rows to finish
            if group.done == 0:
                hit, entry = self.prefix.lookup(group.ids)
                if entry is not None:
                    self.cache.load_stage(entry.kv, hit)
                    group.done = hit
                    if self.record_routes:
                        assert entry.routes is not None  # every entry records them
                        group.routes.append(entry.routes[:hit])
            take = min(budget, len(group.ids) - group.done)
            chunk = group.ids[group.done : group.done + take]
            logits = self.cache.prefill(chunk, group.done)
            if self.cache.routes is not None:
                group.routes.append(self.cache.routes)
            group.done += take
            budget -= take
            self.prefill_tokens += take
            if group.done < len(group.ids):
                return  # the rest after the next decode step
            self._groups.popleft()
            routes = torch.cat(group.routes) if self.record_routes else None
            for s in group.seqs:
                s.prompt_routes = routes
            self.prefix.insert(group.ids, partial(self.cache.export, None, len(group.ids)),
                               routes)
            b = len(self._running)
            self.cache.stage_to_slots(list(range(b, b + len(group.seqs))), len(group.ids))
            self._running.extend(group.seqs)
            self._sample(group.seqs, logits.expand(len(group.seqs), -1), first=b)

    def _decode(self) -> None:
        running = self._running
        dev = self.cache.device
        tokens = torch.tensor([s.tokens[-1] for s in running], dtype=torch.long, device=dev)
        pos = torch.tensor([s.length for s in running], dtype=torch.long, device=dev)
        logits = self.cache.decode(tokens, pos)
        if self.cache.routes is not None:  # the experts of each row's token just fed
            for s, r in zip(running, self.cache.routes.unbind(), strict=True):
                s.routes.append(r)
        self.batches += 1
        self.max_running = max(self.max_running, len(running))
        self._sample(list(running), logits, first=0)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, first: int) -> None:
        """Sample one token for seqs, the running rows first..first+len-1, from logits (N,V);
        then retire the rows that finished. Plain greedy rows (no penalty, logit bias or
        grammar) of all requests are decided together; the others per request, with its own
        generator."""
        raw_all = logits.float().cpu()  # sampling runs on the CPU with each job's generator
        plain = [i for i, s in enumerate(seqs)
                 if s.job.params.temperature == 0.0 and s.job.params.repetition_penalty == 1.0
                 and not s.job.params.logit_bias and s.rule is None]
        if plain:
            sub = raw_all if len(plain) == len(seqs) else raw_all[plain]
            logp = torch.log_softmax(sub, dim=-1)  # greedy: the model's own logprobs
            nxt = sub.argmax(-1)
            self._record([seqs[i] for i in plain], nxt, logp)
        by_job: dict[int, list[int]] = {}
        taken = set(plain)
        for i, s in enumerate(seqs):
            if i not in taken:
                by_job.setdefault(id(s.job), []).append(i)
        for rows in by_job.values():
            # The request's rows in its own order: moving rows between slots reorders them,
            # and its generator must meet them in the same order whatever else runs.
            rows.sort(key=lambda i: seqs[i].row)
            job = seqs[rows[0]].job
            nxt, logp = self._draw(job, [seqs[i] for i in rows], raw_all[rows])
            self._record([seqs[i] for i in rows], nxt, logp)
        finished = [first + i for i, s in enumerate(seqs) if self._finished(s)]
        for slot in sorted(finished, reverse=True):
            self._retire(slot)

    def _draw(self, job: Any, seqs: list[_Seq], raw: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's next tokens (N,) and the logprobs of its sampling distribution."""
        params = job.params
        state = self._state[id(job)]
        raw = logit_bias(raw, params.logit_bias)
        if params.constraint is not None:
            raw = constrain(raw, [s.rule for s in seqs if s.rule is not None])
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(raw.shape, dtype=torch.bool)
            for r, s in enumerate(seqs):
                seen[r, s.prompt + s.tokens] = True
            raw = repetition_penalty(raw, seen, params.repetition_penalty)
        if params.temperature == 0.0:  # greedy: the model's own logprobs (temperature 1)
            return raw.argmax(-1), torch.log_softmax(raw, dim=-1)
        logp = torch.log_softmax(raw / params.temperature, dim=-1)
        probs = logp.exp()
        probs = top_k_filter(probs, params.top_k)
        probs = top_p_filter(probs, params.top_p)
        probs = min_p_filter(probs, params.min_p)
        return torch.multinomial(probs, 1, generator=state.generator).squeeze(-1), logp

    def _record(self, seqs: list[_Seq], nxt: torch.Tensor, logp: torch.Tensor) -> None:
        """Append each row's token, its logprob and (when its request asks) the top
        alternatives; check stop strings; stream the token."""
        chosen = logp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
        picked = nxt.tolist()
        for r, s in enumerate(seqs):
            params = s.job.params
            s.tokens.append(picked[r])
            s.logprobs.append(chosen[r])
            if s.rule is not None:
                s.rule.advance(picked[r])
            alts: list[tuple[int, float]] = []
            if params.top_logprobs:
                vals, idx = logp[r].topk(params.top_logprobs)
                alts = list(zip(idx.tolist(), vals.tolist(), strict=True))
                s.tops.append(alts)
            if params.stop and picked[r] != self.eos:
                text: str = self.tok.decode(s.tokens, skip_special_tokens=True)
                s.hit_stop = cut_at_stop(text, list(params.stop))[1]
            if s.job.on_token is not None:
                s.job.on_token(TokenEvent(s.row, picked[r], chosen[r], alts))

    def _finished(self, s: _Seq) -> bool:
        return (s.tokens[-1] == self.eos or s.hit_stop
                or len(s.tokens) >= s.job.params.max_tokens
                or len(s.prompt) + len(s.tokens) >= self.context)

    def _retire(self, slot: int) -> None:
        """Finish the row in `slot`; the last running row moves into it."""
        s = self._running[slot]
        job, state = s.job, self._state[id(s.job)]
        routes = None
        if s.prompt_routes is not None:
            fed = torch.stack(s.routes) if s.routes else s.prompt_routes[:0]
            unfed = torch.full_like(s.prompt_routes[:1], NO_ROUTE)  # the last token
            routes = (s.prompt_routes, torch.cat([fed, unfed]))
        if job.n == 1:  # a conversation's next turn starts with this prompt + completion
            ids = s.prompt + s.tokens[:-1]
            self.prefix.insert(ids, lambda: self.cache.export(slot, len(ids)),
                               None if routes is None else torch.cat([routes[0], routes[1][:-1]]))
        last = len(self._running) - 1
        if slot != last:
            self.cache.move_slot(last, slot, self._running[last].length)
            self._running[slot] = self._running[last]
        self._running.pop()
        full: str = self.tok.decode(s.tokens, skip_special_tokens=True)
        text, hit = cut_at_stop(full, list(job.params.stop))
        ended = s.tokens[-1] == self.eos
        state.samples[s.row] = Sample(
            s.tokens, s.logprobs, s.tops, text,
            "stop" if ended or hit else "length", eos=ended, routes=routes)
        state.left -= 1
        if state.left == 0:
            del self._state[id(job)]
            done: list[Sample] = [x for x in state.samples if x is not None]
            job.future.set_result([done[i * job.n : (i + 1) * job.n]
                                   for i in range(len(job.prompts))])

    def _fail_all(self, exc: Exception) -> None:
        jobs = {id(s.job): s.job for s in self._running}
        jobs.update({id(g.job): g.job for g in self._groups})
        self._running.clear()
        self._groups.clear()
        for key, job in jobs.items():
            self._state.pop(key, None)
            if not job.future.done():
                job.future.set_exception(exc)


def weights_version(model: torch.nn.Module) -> tuple[int, ...]:
    """Changes whenever any parameter is written in place (an optimizer step, a weight load):
    torch bumps a tensor's version counter on every in-place write, views sharing their base's,
    so a flat-buffer optimizer's writes count too."""
    return tuple(p._version for p in model.parameters())


class ContinuousRollout(HFRollout):
    """The RL engine's `hf` rollout backend on the continuous scheduler the server runs
    (`rollout.engine = "continuous"`): rows leave the batch as they finish, a group's prompt
    is prefilled once, and a multi-turn episode's next turn reuses the keys of the context it
    continues (the prefix cache). Returns what `HFRollout` returns, laid out the same way:
    sampled tokens, their logprobs under the sampling distribution, and each token's experts.

    Each call samples from the model's current weights: the fused weights are rebuilt, and
    the cached prefixes, computed by older weights, are dropped after `sync_weights` (the
    trainer calls it after every update) or when a parameter was written in place since the
    last call (`weights_version`; an optimizer that swapped `param.data` for views of a flat
    buffer writes without bumping it, hence the explicit call). The scheduler's thread is
    stopped by `close` (or when the backend is collected)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, prefill_chunk: int = 512,
                 prefix_cache_tokens: int = 16384) -> None:
        if not supported(model):
            raise ValueError("rollout.engine = 'continuous' samples through the lean forward "
                             "of a plain fp32 Qwen3-MoE (workers/rl/lean.py); this model is not "
                             "one (another architecture, RoPE scaling, ZeRO-3 partitioning or "
                             "expert parallelism): use rollout.engine = 'batch'")
        super().__init__(model, tokenizer)
        self.prefill_chunk, self.prefix_cache_tokens = prefill_chunk, prefix_cache_tokens
        self.scheduler: ContinuousScheduler | None = None
        self._version: tuple[int, ...] = ()
        self._stale = False  # sync_weights since the last call: cached keys are old
        self._stop: Callable[[], Any] | None = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            self.close()
        self._stale = True
        super().sync_weights(model)

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
        self.scheduler, self._stop = None, None

    def ready(self, rows: int, length: int) -> ContinuousScheduler:
        """The scheduler, with room for `rows` rows side by side and `length` positions each,
        on the current weights. Like `HFRollout`, sequences may run past the checkpoint's
        `max_position_embeddings` (default RoPE is defined at every position)."""
        version = weights_version(self.model)
        sched = self.scheduler
        if sched is None or sched.max_rows < rows or sched.context < length:
            self.close()
            config = getattr(self.model, "config", None)
            context = max(length, getattr(config, "max_position_embeddings", None) or 0)
            # The scheduler's thread decodes with its own tokenizer copy (fast tokenizers
            # refuse concurrent calls) and records routes, as the hf backend does.
            sched = ContinuousScheduler(
                self.model, copy.deepcopy(self.tok), context, max(rows, 8),
                prefill_chunk=self.prefill_chunk,
                prefix_cache_tokens=self.prefix_cache_tokens, record_routes=True)
            self.scheduler, self._stop = sched, weakref.finalize(self, sched.close)
        else:
            sched.refresh(keep_prefixes=version == self._version and not self._stale)
        self._version, self._stale = version, False
        return sched

    def generate(
        self, prompts: Sequence[Prompt], spec: RolloutSpec, generator: torch.Generator, *,
        controls: SamplingControls | None = None, on_step: StepHook | None = None,
    ) -> RolloutBatch:
        if on_step is not None:
            raise ValueError("streaming (on_step) is the server's: its batcher reports tokens")
        keys = [p if isinstance(p, str) else tuple(int(t) for t in p) for p in prompts]
        ids = self.token_ids(keys)
        c = controls or SamplingControls()
        params = SamplingParams(
            temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_new_tokens,
            stop=tuple(spec.stop), top_k=c.top_k, min_p=c.min_p,
            repetition_penalty=c.repetition_penalty, logit_bias=c.logit_bias,
            constraint=c.constraint)
        # One draw from the caller's generator seeds the request: the same generator state
        # gives the same samples, whatever the scheduler runs beside them.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        # A GRPO batch is runs of equal prompts: submitted as (distinct prompt, n samples),
        # each prefilled once. Otherwise row by row (the prefix cache still shares prompts).
        runs: list[tuple[int, int]] = []  # (first row, length)
        for i, key in enumerate(keys):
            if runs and keys[runs[-1][0]] == key:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        n = runs[0][1]
        grouped = all(length == n for _, length in runs)
        job_prompts: list[Prompt] = [ids[i] for i, _ in runs] if grouped else list(ids)
        sched = self.ready(len(keys), max(map(len, ids)) + spec.max_new_tokens)
        future = sched.submit(job_prompts, n if grouped else 1, params, seed)
        samples = [s for per_prompt in future.result() for s in per_prompt]
        return self.batch(ids, samples)

    def batch(self, ids: list[list[int]], samples: list[Sample]) -> RolloutBatch:
        """`HFRollout`'s layout: left-padded prompts, right-padded completions, routes with
        NO_ROUTE on padding."""
        prompt_ids, prompt_mask = left_pad(ids, self.tok.pad_token_id)
        b, p, c = len(samples), prompt_ids.shape[1], max(len(s.token_ids) for s in samples)
        comp = torch.full((b, c), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, c), dtype=torch.long)
        logprobs = torch.zeros((b, c), dtype=torch.float32)
        for r, s in enumerate(samples):
            t = len(s.token_ids)
            comp[r, :t] = torch.tensor(s.token_ids, dtype=torch.long)
            mask[r, :t] = 1
            logprobs[r, :t] = torch.tensor(s.logprobs, dtype=torch.float32)
        p_routes = c_routes = None
        if samples[0].routes is not None:
            shape = samples[0].routes[0].shape[1:]
            dtype = samples[0].routes[0].dtype
            p_routes = torch.full((b, p, *shape), NO_ROUTE, dtype=dtype)
            c_routes = torch.full((b, c, *shape), NO_ROUTE, dtype=dtype)
            for r, s in enumerate(samples):
                assert s.routes is not None
                prompt_r, comp_r = s.routes
                p_routes[r, p - prompt_r.shape[0]:] = prompt_r
                c_routes[r, : comp_r.shape[0]] = comp_r
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                            completion_ids=comp, completion_mask=mask, logprobs=logprobs,
                            texts=[s.text for s in samples], prompt_routes=p_routes,
                            completion_routes=c_routes)
