"""The completion forward: the policy (or a frozen reference) run on prompt + completion as
laid out at sampling time, returning the logits that score each completion token and, for a
mixture-of-experts model, each layer's router logits.

Shared by SFT, the preference phase and the RL update, so every phase scores a completion the
same way; the losses that consume the logits are pure functions in `workers.rl.losses`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from workers.rl.lean import LeanQwen3Moe
from workers.rl.lean import supported as lean_supported
from workers.rl.losses import token_logprobs
from workers.rl.objectives import Example
from workers.rl.rollout import RolloutBatch, position_ids
from workers.rl.route_taps import RouterTap, replayable_routers
from workers.rl.routing import ReplayBindingError, check_replayed

Router = Sequence[torch.Tensor] | None  # one (tokens, experts) logits tensor per layer


def pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask: completions start at column 0."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]] | None:
    """The modules whose output (at the index given) is a layer's router logits, in forward
    order, read from the transformers model's own output-recording table; None if it has none
    we can hook plainly."""
    if model in _ROUTERS:
        return _ROUTERS[model]
    from transformers.utils.output_capturing import OutputRecorder

    rec = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    found = None
    if isinstance(rec, OutputRecorder) and rec.layer_name is None and rec.class_name is None:
        found = [(m, rec.index) for m in model.modules() if isinstance(m, rec.target_class)]
    elif isinstance(rec, type):
        found = [(m, 0) for m in model.modules() if isinstance(m, rec)]
    _ROUTERS[model] = found or None
    return _ROUTERS[model]


def lean_trainable(module: Any) -> torch.nn.Module | None:
    """The model whose training forward can run as `LeanQwen3Moe.train_forward`, or None: a
    model the lean forward supports, bare or wrapped by a stage-0 DeepSpeed engine (whose forward
    adds nothing but timers; ZeRO optimizers hook the engine's forward outputs). Any other
    wrapper's own forward is respected."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if hasattr(module, "zero_optimization_stage"):  # a DeepSpeed engine
        if module.zero_optimization_stage() != 0 or isinstance(
                getattr(module, "optimizer", None), ZeROOptimizer):
            return None
        module = module.module
    if isinstance(module, torch.nn.Module) and lean_supported(module):
        return module
    return None


def forward_completion(module: Any, batch: RolloutBatch, sl: slice, moe: bool,
                       device: torch.device, lean: bool = True
                       ) -> tuple[torch.Tensor, Router, torch.Tensor]:
    """`forward_routed` without the routes: completion logits, router logits and their mask."""
    logits, router, mask, _ = forward_routed(module, batch, sl, moe, device, lean)
    return logits, router, mask


def replay_routes(batch: RolloutBatch, sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's recorded prompt and completion routes of rows `sl`, for router replay;
    a batch without them is refused (its backend does not record routes)."""
    if batch.prompt_routes is None or batch.completion_routes is None:
        raise ReplayBindingError("moe.router_replay: this batch carries no recorded routes "
                                 "(its rollout backend or objective does not record them)")
    return batch.prompt_routes[sl], batch.completion_routes[sl]


def forward_routed(module: Any, batch: RolloutBatch, sl: slice, moe: bool,
                   device: torch.device, lean: bool = True, replay: bool = False
                   ) -> tuple[torch.Tensor, Router, torch.Tensor, torch.Tensor | None]:
    """Run the policy on prompt+completion, as laid out at sampling time.
    Returns completion logits (b,C,V), router logits per layer ((b*L),E) or None, the
    (b*L,) attention mask that router logits are aligned with, and for a Qwen3-MoE (with
    `moe`) the routes the forward used, (b,L,layers,k) over prompt + completion in the
    batch's layout (see `RolloutBatch`), None for other models.

    `replay` (router replay): every token the sampler recorded a route for -- prompt tokens
    as routed at prefill, completion tokens as routed when fed back -- is routed to exactly
    those experts, with weights from this forward's own router logits; the rest (padding,
    each row's last sampled token, which scores nothing) keep their own routing.

    With `lean` (and a model it supports) the forward is `LeanQwen3Moe.train_forward`: the same
    mathematics as the transformers forward (logits and gradients equal to float rounding) in
    fewer ops. Otherwise the transformers forward runs, and router logits are read by forward
    hooks on the router modules for this one call: asking it for `output_router_logits` also
    makes it compute its own auxiliary loss, which the trainer does not use (it computes its
    per-layer one from the same logits)."""
    p_ids, p_mask = batch.prompt_ids[sl], batch.prompt_mask[sl]
    c_ids, c_mask = batch.completion_ids[sl], batch.completion_mask[sl]
    ids = torch.cat([p_ids, c_ids], 1).to(device)  # (b, L = P + C)
    mask = torch.cat([p_mask, c_mask], 1).to(device)
    p = p_ids.shape[1]
    p_routes = c_routes = None
    if replay:
        p_routes, c_routes = (r.to(device) for r in replay_routes(batch, sl))
    model = lean_trainable(module) if lean else None
    if model is not None:
        lean_fwd = LeanQwen3Moe(model, 0, ids.shape[1])
        packed = lean_fwd.train_forward_packed(p_ids.to(device), p_mask.to(device),
                                               c_ids.to(device), c_mask.to(device),
                                               p_routes, c_routes)
        if packed is not None:
            logits, routers, weights = packed
            return logits, (routers if moe else None), weights, \
                (lean_fwd.routes if moe else None)
        forced = None
        if p_routes is not None and c_routes is not None:
            forced = torch.cat([p_routes, c_routes], 1)
        logits, routers = lean_fwd.train_forward(ids, mask, forced)
        return logits[:, p - 1 : -1], (routers if moe else None), mask.reshape(-1), \
            (lean_fwd.routes if moe else None)
    gates = replayable_routers(module) if moe else None
    if replay and gates is None:
        raise ReplayBindingError("moe.router_replay needs a Qwen3-MoE with a sparse MoE block "
                                 "in every layer; this model's routers cannot be replayed")
    forced = None
    if p_routes is not None and c_routes is not None:
        forced = torch.cat([p_routes, c_routes], 1).flatten(0, 1)  # (b*L,layers,k)
    route_tap = RouterTap(gates, forced) if gates else None
    taps = router_modules(getattr(module, "module", module)) if moe else None
    captured: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _a, out, i=i: captured.append(out[i]))
               for m, i in taps or []]
    kwargs: dict[str, Any] = {"output_router_logits": True} if moe and not taps else {}
    used = None
    try:
        if route_tap is not None:
            route_tap.__enter__()
        out = module(
            input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
            use_cache=False, **kwargs,
        )
        if route_tap is not None:
            used = route_tap.take().view(*ids.shape, len(route_tap.routers), -1)
    finally:
        if route_tap is not None:
            route_tap.__exit__()
        for h in handles:
            h.remove()
    logits = out.logits[:, p - 1 : -1]  # (b,C,V): position t predicts completion token t
    router = None
    if moe:
        router = tuple(captured) if taps else getattr(out, "router_logits", None)
    return logits, router, mask.reshape(-1), used




def completion_batch(tok: Any, examples: Sequence[Example]) -> RolloutBatch:
    """Reference completions (each ended by EOS) laid out like a rollout, for the warm-start
    phases (SFT and preference), which score given completions instead of sampled ones."""
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True,
              add_special_tokens=False)
    comp = [tok(e.reference, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for e in examples]
    c_ids, c_mask = pad_right(comp, tok.pad_token_id)
    zeros = torch.zeros(c_ids.shape)
    return RolloutBatch(enc["input_ids"], enc["attention_mask"], c_ids, c_mask, zeros, [])


def sequence_logps(module: Any, batch: RolloutBatch, moe: bool, device: torch.device
                   ) -> tuple[torch.Tensor, Router, torch.Tensor]:
    """Summed completion log-probabilities (N,), router logits and their (N*L,) mask, from one
    forward pass over the whole batch (the preference phase's sequence scores)."""
    logits, router, flat_mask = forward_completion(module, batch, slice(None), moe, device)
    mask = batch.completion_mask.to(device).float()
    logp = token_logprobs(logits, batch.completion_ids.to(device))
    return (logp * mask).sum(-1), router, flat_mask


@torch.no_grad()
def reference_logprobs(ref: torch.nn.Module, batch: RolloutBatch, micro: int,
                       device: torch.device, temperature: float) -> torch.Tensor:
    """Per-token log-probabilities (N,C) of the sampled completions under the frozen
    reference, micro-batch by micro-batch as the update will read them, kept on the CPU."""
    n_seq = batch.completion_ids.shape[0]
    return torch.cat([
        token_logprobs(forward_completion(ref, batch, slice(i, i + micro), False, device)[0],
                       batch.completion_ids[i:i + micro].to(device), temperature).float().cpu()
        for i in range(0, n_seq, micro)
    ])


@torch.no_grad()
def replay_self_test(module: Any, vocab: int, device: torch.device, seed: int = 0) -> None:
    """Router replay's check at start: one forward over a probe batch with random routes --
    two rows sharing a prompt, so a packed forward shares it too -- through the very path the
    trainer will use, whose every layer must then have used exactly those routes
    (`check_replayed`). Catches routes bound to the wrong layers, a router that does not run
    once per layer, and a model whose routers cannot be forced, before any step. Every rank
    runs it (a ZeRO-3 forward is collective)."""
    gates = replayable_routers(module)
    if gates is None:
        raise ReplayBindingError("moe.router_replay needs a Qwen3-MoE with a sparse MoE block "
                                 "in every layer; this model's routers cannot be replayed")
    g = torch.Generator().manual_seed(seed)
    gate: Any = gates[0]
    n_exp, k = int(gate.num_experts), int(gate.top_k)
    n_layers, p, c = len(gates), 3, 4

    def random_routes(rows: int, t: int) -> torch.Tensor:
        return torch.rand((rows, t, n_layers, n_exp), generator=g).argsort(-1)[..., :k]

    prompt = torch.randint(0, vocab, (1, p), generator=g).expand(2, p)
    probe = RolloutBatch(
        prompt_ids=prompt.clone(), prompt_mask=torch.ones((2, p), dtype=torch.long),
        completion_ids=torch.randint(0, vocab, (2, c), generator=g),
        completion_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        logprobs=torch.zeros((2, c)), texts=["", ""],
        prompt_routes=random_routes(1, p).expand(2, p, n_layers, k).clone(),
        completion_routes=random_routes(2, c).masked_fill(
            torch.tensor([[False] * 4, [False, False, True, True]])[..., None, None], -1))
    used = forward_routed(module, probe, slice(None), True, device, replay=True)[3]
    recorded = torch.cat([probe.prompt_routes, probe.completion_routes], 1)  # type: ignore[list-item]
    if used is None:
        raise ReplayBindingError("moe.router_replay: the trainer's forward reported no routes")
    check_replayed(recorded, used.cpu(), " (start-up check)")
