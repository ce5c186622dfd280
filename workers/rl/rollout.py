"""Rollout generation behind one interface, so a vLLM backend can replace the HF one.

A backend returns token ids and the sampling policy's per-token logprobs, laid out exactly as
the trainer will re-score them: left-padded prompt, then right-padded completion; for a
Qwen3-MoE the `hf` backend also returns each token's experts per layer (the routes the
trainer's mismatch metrics and router replay read, see workers/rl/routing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from workers.rl.lean import lean_decoder
from workers.rl.route_taps import RouterTap, replayable_routers
from workers.rl.routing import NO_ROUTE
from workers.rl.spec import RolloutSpec


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (B,P) left-padded
    prompt_mask: torch.Tensor  # (B,P) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (B,C) right-padded with pad id
    completion_mask: torch.Tensor  # (B,C) 1 on sampled tokens, including the eos/stop token
    logprobs: torch.Tensor  # (B,C) log-prob of each sampled token under the sampling policy
    texts: list[str]  # decoded completions, cut at the first stop string
    # Mixture-of-experts routes the sampler used (workers.rl.routing), or None (a dense model,
    # or a backend that does not record them): per token and MoE layer, its top-k experts.
    # NO_ROUTE on padding and on the last sampled token (never fed through the model).
    prompt_routes: torch.Tensor | None = field(default=None, kw_only=True)  # (B,P,L,k)
    completion_routes: torch.Tensor | None = field(default=None, kw_only=True)  # (B,C,L,k)

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


Prompt = str | Sequence[int]
"""A prompt as text (tokenized by the backend) or as token ids, used exactly as given: a
multi-turn episode's context, whose ids must not be decoded and re-encoded between turns."""


class RolloutBackend(Protocol):
    def generate(
        self, prompts: Sequence[Prompt], spec: RolloutSpec, generator: torch.Generator
    ) -> RolloutBatch:
        """Sample one completion per prompt. A prompt given as token ids comes back in
        `prompt_ids` unchanged (after its left padding)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the backend sample from the trainer's current weights (a no-op when shared)."""
        ...


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, so a prompt's tokens sit at 0..n-1 in any batch."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set whose mass reaches top_p; renormalise. (B,V)."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def top_k_filter(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k most likely tokens (ties at the k-th kept too); renormalise. (B,V)."""
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    kth = probs.topk(k, dim=-1).values[..., -1:]  # (B,1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens at least `min_p` times as likely as the most likely one; renormalise."""
    if min_p <= 0.0:
        return probs
    floor = probs.max(-1, keepdim=True).values * min_p  # (B,1)
    kept = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The CTRL / vLLM / transformers penalty on tokens already in the prompt or the output:
    a positive logit is divided by `penalty`, a negative one multiplied. (B,V), seen bool."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's `logit_bias`: each (token id, bias) added to that token's logit in every row
    (-100 / 100 in effect ban / force the token). (B,V) -> (B,V)."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    vals = torch.tensor([v for _, v in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, vals.expand(logits.shape[0], -1))


class TokenConstraint(Protocol):
    """One row's constrained decoding state (the inference server's structured output): which
    tokens may come next, and the token that came. The RL engine never builds one."""

    def allowed(self, vocab: int) -> torch.Tensor:
        """(vocab,) bool: the tokens the constraint admits next (eos once it accepts)."""
        ...

    def advance(self, token: int) -> None:
        """Consume the sampled token."""
        ...


def constrain(logits: torch.Tensor, rows: Sequence[TokenConstraint]) -> torch.Tensor:
    """Each row's disallowed tokens set to -inf, so no sampler or argmax can pick them.
    (B,V) -> (B,V), one constraint per row."""
    allowed = torch.stack([c.allowed(logits.shape[-1]) for c in rows]).to(logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass(frozen=True)
class SamplingControls:
    """vLLM-style sampling controls beyond temperature and top-p, for the inference server:
    applied as vLLM orders them (logit bias, penalty, temperature, top-k, top-p, min-p). The
    RL engine's own sampling leaves them off."""

    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # builds one row's constraint (structured output); None: unconstrained
    constraint: Callable[[], TokenConstraint] | None = None

    @property
    def neutral(self) -> bool:
        return (self.top_k <= 0 and self.min_p <= 0.0 and self.repetition_penalty == 1.0
                and not self.logit_bias and self.constraint is None)


# Called after every decode step with (step, sampled ids (B,), the step's logits (B,V) after any
# repetition penalty and before temperature, the (B,) rows that sampled a token this step).
StepHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as a left-padded (N,P) id tensor and its (N,P) mask, as a tokenizer with
    `padding_side="left"` pads text."""
    width = max((len(s) for s in seqs), default=0)
    # built as lists, then one tensor each (a tensor per row cost more than the rest)
    ids = torch.tensor([[pad_id] * (width - len(s)) + [int(t) for t in s] for s in seqs],
                       dtype=torch.long).reshape(len(seqs), width)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs],
                        dtype=torch.long).reshape(len(seqs), width)
    return ids, mask


PROMPT_CACHE = 65_536  # prompt texts whose token ids a backend remembers


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class HFRollout:
    """Batched sampling with the KV cache straight from a Hugging Face causal LM.

    `lockstep` keeps decoding until max_new_tokens even when every row has finished: ZeRO-3
    ranks gather parameters collectively in each forward, so all ranks must run equally many.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, lockstep: bool = False,
                 share_prefix: bool = True):
        self.model = model
        self.tok = tokenizer
        self.lockstep = lockstep
        # A group's copies of one prompt prefill once (off only to measure what that saves).
        self.share_prefix = share_prefix
        self._modules: tuple[torch.nn.Module | None, list[torch.nn.Module]] = (None, [])
        self._ids: dict[str, list[int]] = {}  # prompt text -> token ids (`token_ids`)
        self._texts: dict[tuple[int, ...], str] = {}  # completion ids -> text (`texts`)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    def generate(
        self, prompts: Sequence[Prompt], spec: RolloutSpec, generator: torch.Generator, *,
        controls: SamplingControls | None = None, on_step: StepHook | None = None,
    ) -> RolloutBatch:
        """`controls` and `on_step` serve the inference server (top-k, min-p and repetition
        penalty; per-token logprobs and streaming); the RL engine passes neither."""
        uniq_ids, uniq_mask, rows = self.encode(prompts)
        restore = self.eval_mode()
        try:
            # no_grad, not inference_mode: ZeRO-3 gathers parameters inside this forward and
            # lazily built buffers may be created here, and the trainer's autograd later
            # uses both (inference tensors cannot be saved for backward).
            with torch.no_grad():
                ids, lp, mask, routes = self.sample(uniq_ids, uniq_mask, rows, spec, generator,
                                                    controls, on_step)
        finally:
            restore()
        comp, mask, lp = ids.cpu(), mask.cpu(), lp.cpu()
        p_routes, c_routes = routes if routes is not None else (None, None)
        return RolloutBatch(
            prompt_ids=uniq_ids[rows],
            prompt_mask=uniq_mask[rows],
            completion_ids=comp,
            completion_mask=mask,
            logprobs=lp,
            texts=self.texts(comp, mask, spec.stop),
            prompt_routes=p_routes,
            completion_routes=c_routes,
        )

    def eval_mode(self) -> Callable[[], object]:
        """Switch every module to eval mode; returns what puts each module's mode back.

        Flags are set directly on a cached module list: `Module.eval()` walks the module tree
        (about 1 ms per call on the tiny preset, twice per generate call)."""
        model = self.model
        if getattr(model, "use_kernels", False):  # transformers re-selects kernels on a switch
            was = model.training
            model.eval()
            return lambda: model.train(was)
        if self._modules[0] is not model:
            self._modules = (model, list(model.modules()))
        # `training` is a plain instance attribute: written straight into each module's
        # __dict__, skipping `Module.__setattr__`'s parameter/buffer/module checks (~5 us a
        # module, ~0.3 ms a call on the tiny preset).
        modes = [(m.__dict__, m.training) for m in self._modules[1]]
        for d, _ in modes:
            d["training"] = False

        def restore() -> None:
            for d, training in modes:
                d["training"] = training

        return restore

    def encode(self, prompts: Sequence[Prompt]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask of the distinct prompts, and the (B,) row of each prompt
        in them: a group repeats its prompt `group_size` times, tokenized and prefilled once.
        A prompt may also be given as token ids (used as they are)."""
        if self.share_prefix and getattr(self.tok, "padding_side", "left") != "left":
            uniq = list(dict.fromkeys(prompts))
            if all(isinstance(p, str) for p in uniq):  # the tokenizer's own padding
                enc = self.tok(uniq, return_tensors="pt", padding=True,
                               add_special_tokens=False)
                row = {p: i for i, p in enumerate(uniq)}
                idx = torch.tensor([row[p] for p in prompts], dtype=torch.long)
                return enc["input_ids"], enc["attention_mask"], idx
        keys = [p if isinstance(p, str) else tuple(int(t) for t in p) for p in prompts]
        uniq_keys = list(dict.fromkeys(keys)) if self.share_prefix else keys
        seqs = self.token_ids(uniq_keys)
        ids, mask = left_pad(seqs, self.tok.pad_token_id)
        if not self.share_prefix:  # every row its own prompt
            return ids, mask, torch.arange(len(keys), dtype=torch.long)
        at = {k: i for i, k in enumerate(uniq_keys)}
        return ids, mask, torch.tensor([at[k] for k in keys], dtype=torch.long)

    def token_ids(self, keys: Sequence[str | tuple[int, ...]]) -> list[list[int]]:
        """Each prompt's token ids; a text's are tokenized once per backend and remembered
        (an RL run samples the same training prompts over and over, and the tokenizer call
        costs more than the rest of the step's bookkeeping). Bounded: the memory is dropped
        when it holds `PROMPT_CACHE` texts."""
        texts = [k for k in dict.fromkeys(keys) if isinstance(k, str) and k not in self._ids]
        if texts:
            if len(self._ids) + len(texts) > PROMPT_CACHE:
                self._ids.clear()
            enc = self.tok(texts, add_special_tokens=False)["input_ids"]
            self._ids.update(zip(texts, (list(e) for e in enc), strict=True))
        return [list(self._ids[k]) if isinstance(k, str) else list(k) for k in keys]

    def sample(
        self,
        uniq_ids: torch.Tensor,
        uniq_mask: torch.Tensor,
        rows: torch.Tensor,
        spec: RolloutSpec,
        generator: torch.Generator,
        controls: SamplingControls | None = None,
        on_step: StepHook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
               tuple[torch.Tensor, torch.Tensor] | None]:
        """The decode loop: (B,C) ids, logprobs and mask, C <= max_new_tokens, and for a
        Qwen3-MoE the routes it used: prompt (B,P,L,k) and completion (B,C,L,k), see
        `RolloutBatch`; None for other models.

        The prompt pass runs once per distinct prompt and its KV cache is copied out to the
        rows sharing it. Buffers are preallocated; no forward runs after the last sampled
        token, and without lockstep the loop stops as soon as every row has finished.
        """
        lean = None
        if not self.lockstep:
            # The lean decode loop reads the policy's parameters and writes only tensors of its
            # own, so (unless a caller's hook sees its tensors) it runs under inference mode:
            # the same kernels, so the same bits, with less dispatch per op than no_grad (no
            # version counters or view tracking), ~10% of a sampling pass on the tiny models.
            # Its outputs are cloned out of inference mode: the trainer's autograd reads them.
            with torch.inference_mode(on_step is None):
                lean = lean_decoder(self.model, rows.shape[0],
                                    uniq_ids.shape[1] + spec.max_new_tokens)
                if lean is not None:
                    ids, lp, mask, routes = self.decode(uniq_ids, uniq_mask, rows, spec,
                                                        generator, controls, on_step, lean,
                                                        None)
            if lean is not None:
                if on_step is not None:
                    return ids, lp, mask, routes
                return ids.clone(), lp.clone(), mask.clone(), (
                    None if routes is None else (routes[0].clone(), routes[1].clone()))
        routers = None if lean is not None else replayable_routers(self.model)
        tap = RouterTap(routers) if routers else None
        if tap is None:
            return self.decode(uniq_ids, uniq_mask, rows, spec, generator, controls, on_step,
                               lean, None)
        with tap:
            return self.decode(uniq_ids, uniq_mask, rows, spec, generator, controls, on_step,
                               lean, tap)

    def decode(
        self, uniq_ids: torch.Tensor, uniq_mask: torch.Tensor, rows: torch.Tensor,
        spec: RolloutSpec, generator: torch.Generator, controls: SamplingControls | None,
        on_step: StepHook | None, lean: Any, tap: RouterTap | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
               tuple[torch.Tensor, torch.Tensor] | None]:
        """`sample`'s loop, with the lean decoder (or None) and the router tap (or None)
        chosen; routes come from the lean forward or the tap after every forward."""
        tok, n_new = self.tok, spec.max_new_tokens
        b, p = rows.shape[0], uniq_ids.shape[1]
        device = next(self.model.parameters()).device
        rows_d = rows.to(device)
        attn = torch.ones((b, p + n_new), dtype=uniq_mask.dtype, device=device)
        attn[:, :p] = uniq_mask.to(device)[rows_d]
        pos = position_ids(attn[:, :p])
        ids = torch.full((b, n_new), tok.pad_token_id, dtype=torch.long, device=device)
        lp = torch.zeros((b, n_new), dtype=torch.float32, device=device)
        mask = torch.zeros((b, n_new), dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        shared = rows.shape[0] > uniq_ids.shape[0]
        take = lean.take_routes if lean is not None else (tap.take if tap else None)
        p_routes = c_routes = None
        if lean is not None:
            logits = lean.prefill(uniq_ids.to(device), uniq_mask.to(device), rows_d)
            shared = True
        elif shared:
            u_mask = uniq_mask.to(device)
            out = self.model(input_ids=uniq_ids.to(device), attention_mask=u_mask,
                             position_ids=position_ids(u_mask), use_cache=True)
            cache, logits = out.cache, out.logits[:, -1][rows_d]  # (B,V)
            if hasattr(cache, "batch_select_indices"):
                cache.batch_select_indices(rows_d)
            else:  # a cache that cannot be copied across rows: prefill every row instead
                shared = False
        if take is not None and shared:  # the distinct prompts' routes, fanned out to rows
            u_routes = take()
            p_routes = u_routes.view(*uniq_ids.shape, *u_routes.shape[1:])[rows_d]
        if not shared:
            if take is not None and lean is None and rows.shape[0] > uniq_ids.shape[0]:
                take()  # the shared prefill's routes, superseded by the per-row one
            out = self.model(input_ids=uniq_ids.to(device)[rows_d], attention_mask=attn[:, :p],
                             position_ids=pos, use_cache=True)
            cache, logits = out.cache, out.logits[:, -1]  # (B,V)
            if take is not None:
                r = take()
                p_routes = r.view(b, p, *r.shape[1:])
        if p_routes is not None:
            p_routes = p_routes.masked_fill(~attn[:, :p].bool()[..., None, None], NO_ROUTE)
            c_routes = torch.full((b, n_new, *p_routes.shape[2:]), NO_ROUTE,
                                  dtype=p_routes.dtype, device=device)
        controls = None if controls is None or controls.neutral else controls
        seen = None  # (B,V) tokens in the prompt or sampled so far, for the repetition penalty
        if controls is not None and controls.repetition_penalty != 1.0:
            p_ids, p_mask = uniq_ids.to(device)[rows_d], uniq_mask.to(device)[rows_d]
            seen = torch.zeros((b, logits.shape[-1]), dtype=torch.long, device=device)
            seen = seen.scatter_add_(1, p_ids * p_mask, p_mask.long()) > 0
        rules = ([controls.constraint() for _ in range(b)]
                 if controls is not None and controls.constraint is not None else None)
        t = 0
        for t in range(n_new):
            raw = logits.float()
            if controls is not None:
                raw = logit_bias(raw, controls.logit_bias)
            if rules is not None:
                raw = constrain(raw, rules)
            if seen is not None:
                raw = repetition_penalty(raw, seen, controls.repetition_penalty)  # type: ignore[union-attr]
            logp = torch.log_softmax(raw / spec.temperature, dim=-1)  # (B,V)
            probs = logp.exp()
            if controls is not None:
                probs = top_k_filter(probs, controls.top_k)
            probs = top_p_filter(probs, spec.top_p)
            if controls is not None:
                probs = min_p_filter(probs, controls.min_p)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)  # (B,1)
            live = ~done
            ids[:, t] = torch.where(done, tok.pad_token_id, nxt.squeeze(-1))
            lp[:, t] = torch.where(done, 0.0, logp.gather(-1, nxt).squeeze(-1))
            mask[:, t] = live
            if rules is not None:
                for i in torch.nonzero(live).flatten().tolist():
                    rules[i].advance(int(ids[i, t]))
            if seen is not None:
                seen[torch.arange(b, device=device), ids[:, t]] |= live
            if on_step is not None:
                on_step(t, ids[:, t], raw, live)
            done = done | (ids[:, t] == tok.eos_token_id)
            if spec.stop:
                self.mark_stopped(ids[:, : t + 1], done, spec.stop)
            if t == n_new - 1 or (not self.lockstep and bool(done.all())):
                break
            if lean is not None:
                logits = lean.step(ids[:, t : t + 1])
            else:
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=ids[:, t : t + 1],
                                 attention_mask=attn[:, : p + t + 1], position_ids=pos,
                                 cache=cache, use_cache=True)
                cache, logits = out.cache, out.logits[:, -1]
            if c_routes is not None and take is not None:  # token t went through the model
                c_routes[:, t] = take()
        n = t + 1
        routes = None
        if p_routes is not None and c_routes is not None:
            c_routes = c_routes[:, :n].masked_fill(~mask[:, :n].bool()[..., None, None],
                                                   NO_ROUTE)
            routes = (p_routes.cpu(), c_routes.cpu())
        return ids[:, :n], lp[:, :n], mask[:, :n], routes

    def mark_stopped(self, so_far: torch.Tensor, done: torch.Tensor, stops: list[str]) -> None:
        """Finish (in place) the live rows whose decoded text now contains a stop string."""
        rows = torch.nonzero(~done).flatten().tolist()
        if not rows:
            return
        seqs = so_far[rows].tolist()
        for i, seq in zip(rows, seqs, strict=True):
            if cut_at_stop(self.tok.decode(seq, skip_special_tokens=True), stops)[1]:
                done[i] = True

    def texts(self, comp: torch.Tensor, mask: torch.Tensor, stops: list[str]) -> list[str]:
        """Decoded completions cut at the first stop string. Each distinct completion is
        decoded once per backend and remembered (short RL completions repeat within and across
        steps, and the tokenizer call is most of this function's cost); the memory is dropped
        when it holds `PROMPT_CACHE` completions."""
        memo = self._texts
        out = []
        for row, m in zip(comp.tolist(), mask.tolist(), strict=True):
            key = tuple(x for x, keep in zip(row, m, strict=True) if keep)
            text = memo.get(key)
            if text is None:
                if len(memo) >= PROMPT_CACHE:
                    memo.clear()
                text = memo[key] = self.tok.decode(list(key), skip_special_tokens=True)
            out.append(cut_at_stop(text, stops)[0] if stops else text)
        return out


def make_backend(name: str, model: torch.nn.Module, tokenizer, lockstep: bool,
                 engine: str = "batch") -> RolloutBackend:
    """The `hf` backend: `HFRollout`, or on `engine = "continuous"` the server's scheduler
    (imported here: `workers.rl.continuous` builds on this module)."""
    if name == "hf" and engine == "continuous":
        if lockstep:
            raise ValueError("rollout.engine = 'continuous' cannot run in lockstep (ZeRO-3 or "
                             "expert parallelism: every rank must run the same forwards); use "
                             "rollout.engine = 'batch'")
        from workers.rl.continuous import ContinuousRollout

        return ContinuousRollout(model, tokenizer)
    if name == "hf":
        return HFRollout(model, tokenizer, lockstep=lockstep)
    raise ValueError(f"unknown rollout backend {name!r}; available: 'hf'")
