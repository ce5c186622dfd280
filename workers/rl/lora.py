"""LoRA RL: the policy trains peft low-rank adapters on a frozen base.

What changes against full fine-tuning, and why each piece lives here:
  - the optimizer (DeepSpeed) sees only the adapter parameters (`requires_grad` is set for
    `lora_` tensors alone), so AdamW state is a few hundred times smaller;
  - the KL reference is the same module with its adapters switched off (`AdaptersOff`), not a
    second copy of the model;
  - weight sync sends the adapters alone to a rollout copy that is itself a peft model (the
    async actor's), or weights merged on the fly (`merged_state`) to a backend that needs a
    full model (vLLM); the base never changes, so neither needs it again;
  - a checkpoint's `hf/` holds the merged model (every consumer of `hf/` keeps working) and
    `hf/adapter/` the adapter in peft format with `base.json`, the base it applies to.

Expert MLPs of Qwen3-MoE are stacked 3-d parameters, not nn.Linear, so peft cannot adapt them;
`LoraSpec` refuses them by name and `apply_lora` refuses any target that is not a Linear.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.rl.spec import LoraSpec

if TYPE_CHECKING:  # peft is imported by LoRA runs only: it adds about a second to start-up
    from peft import PeftModel

ADAPTER = "default"  # peft's name for the one adapter a run trains
ADAPTER_DIR = "adapter"  # inside a checkpoint's hf/ folder
BASE_FILE = "base.json"


class LoraTargetError(ValueError):
    """`model.lora.target_modules` names modules the model lacks or that are not Linear."""


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name component of every nn.Linear in `model` (what peft matches on)."""
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def apply_lora(model: torch.nn.Module, spec: LoraSpec, base: dict[str, Any] | None = None
               ) -> PeftModel:
    """`model` wrapped with fresh adapters (B = 0, so its outputs are unchanged); every other
    parameter frozen. `base`: how to rebuild the base (written beside saved adapters)."""
    from peft import LoraConfig, get_peft_model

    found = linear_names(model)
    other = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()} - found
    missing = [t for t in spec.target_modules if t not in found]
    if missing:
        why = [f"{t} (not an nn.Linear)" if t in other else f"{t} (no such module)"
               for t in missing]
        raise LoraTargetError(f"model.lora.target_modules cannot adapt {', '.join(why)}; "
                              f"this model's Linear layers: {sorted(found)}")
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                     target_modules=list(spec.target_modules), bias="none")
    peft_model = get_peft_model(model, cfg)
    object.__setattr__(peft_model, "crucible_base", base or {})  # plain data, not a module
    return peft_model


def is_lora(module: Any) -> bool:
    """A peft model, bare or inside a DeepSpeed engine (checked without importing peft)."""
    m = getattr(module, "module", module)
    return hasattr(m, "peft_config") and hasattr(m, "disable_adapter")


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors (fresh copies) under the peft model's own key names."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if "lora_" in k}


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a snapshot into a rollout copy: a full state dict strictly, or, into a peft model,
    an adapter-only one whose keys must be exactly the adapter's (nothing silently skipped)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    expected = {k for k in model.state_dict() if "lora_" in k}
    if set(state) != expected:
        raise KeyError(f"adapter snapshot keys differ from the model's adapter: missing "
                       f"{sorted(expected - set(state))[:4]}, unexpected "
                       f"{sorted(set(state) - expected)[:4]}")
    model.load_state_dict(state, strict=False)


def merged_state(module: Any) -> dict[str, torch.Tensor]:
    """The full weights a plain (un-wrapped) model needs to compute what the peft model does:
    base + B @ A * scaling for adapted layers, under the base model's key names. Computed
    aside, never by `merge_adapter`, whose in-place add and subtract would round the base."""
    from peft.tuners.lora import LoraLayer

    base = module.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, sub in base.named_modules():
        if isinstance(sub, LoraLayer) and ADAPTER in sub.lora_A:
            delta = sub.get_delta_weight(ADAPTER)  # type: ignore[attr-defined]
            deltas[f"{name}.base_layer.weight"] = delta
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k, v in base.state_dict().items():
            if "lora_" in k:
                continue
            w = v.detach() + deltas[k].to(v.dtype) if k in deltas else v.detach().clone()
            out[k.replace(".base_layer.", ".")] = w
    return out


class AdaptersOff(torch.nn.Module):
    """The KL reference for a LoRA policy: a forward of the very same module with its adapters
    disabled, which is the frozen base exactly; no second copy of the model is held.

    The policy is kept out of this module's registered children, so the reference owns no
    parameters of its own and nothing treats it as a model to save or move."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy: PeftModel = self.__dict__["policy"]
        with torch.no_grad(), policy.disable_adapter():
            return policy(*args, **kwargs)


def save_adapter(module: Any, out: Path) -> None:
    """The adapter in peft format (`adapter_config.json`, `adapter_model.safetensors`) plus
    `base.json`, the base model it applies to (the preset and seed, or the directory)."""
    d = out / ADAPTER_DIR
    state = {k: v.cpu() for k, v in adapter_state(module).items()}
    module.save_pretrained(str(d), state_dict=state, safe_serialization=True)
    base = getattr(module, "crucible_base", {})
    (d / BASE_FILE).write_text(json.dumps(base, indent=2, sort_keys=True))


def save_merged(module: Any, out: Path, state: dict[str, torch.Tensor]) -> None:
    """The merged model in Hugging Face format, loadable without peft (serving, vLLM, the
    next run's warm start)."""
    module.get_base_model().save_pretrained(out, state_dict=state, safe_serialization=True)


def trainable_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if p.requires_grad}
