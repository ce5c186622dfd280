"""Router hooks on a transformers Qwen3-MoE: record the experts each layer picked, or force
them (router replay), for forwards that do not run through `LeanQwen3Moe` (a bf16 or ZeRO
partitioned model, a DeepSpeed engine with a ZeRO optimizer, lockstep sampling).

Qwen3-MoE's `Qwen3MoeTopKRouter` returns (router logits, top-k weights, top-k indices) and its
sparse block hands the last two to the experts unchanged, so a forward hook on the router that
replaces them changes the experts used and nothing else; the weights are recomputed from the
router's own logits (`routing.force_routes`), so gradients still reach the router.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from workers.rl.routing import ROUTE_DTYPE, ReplayBindingError, force_routes


def replayable_routers(model: Any) -> list[torch.nn.Module] | None:
    """One top-k router per decoder layer, in layer order, for a Qwen3-MoE whose every layer
    is sparse; None for any other model (its routes are not recorded, replay is refused)."""
    model = getattr(model, "module", model)  # a DeepSpeed engine's model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "qwen3_moe":
        return None
    if list(getattr(cfg, "mlp_only_layers", []) or []) or cfg.decoder_sparse_step != 1:
        return None
    layers = list(model.model.layers[: cfg.num_hidden_layers])
    gates = [getattr(getattr(layer, "mlp", None), "gate", None) for layer in layers]
    if any(type(g).__name__ != "Qwen3MoeTopKRouter" for g in gates):
        return None
    return [g for g in gates if g is not None]


class RouterTap:
    """Hooks on `routers` while open (a context manager). Each forward's expert indices are
    kept per layer in the order the layers ran (`take`). With `forced` ((N,L,k), NO_ROUTE rows
    keep the router's own choice), the router of layer i -- bound by its place in `routers`,
    i.e. by module identity -- uses `forced[:, i]`."""

    def __init__(self, routers: list[torch.nn.Module], forced: torch.Tensor | None = None):
        self.routers, self.forced = routers, forced
        self.used: list[torch.Tensor] = []
        self.handles: list[Any] = []

    def __enter__(self) -> RouterTap:
        self.handles = [m.register_forward_hook(partial(self.hook, i))
                        for i, m in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def hook(self, i: int, module: torch.nn.Module, args: tuple[Any, ...],
             out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
        logits, _, idx = out
        if self.forced is None:
            self.used.append(idx)
            return None
        weights, idx = force_routes(logits, idx, self.forced[:, i],
                                    bool(getattr(module, "norm_topk_prob", True)))
        self.used.append(idx)
        return logits, weights, idx

    def take(self) -> torch.Tensor:
        """The last forward's indices, (N,L,k) as ROUTE_DTYPE in the order the layers ran."""
        used, self.used = self.used, []
        if len(used) != len(self.routers):
            raise ReplayBindingError(f"{len(self.routers)} MoE layers but their routers ran "
                                     f"{len(used)} times in one forward")
        return torch.stack(used, 1).to(ROUTE_DTYPE)
