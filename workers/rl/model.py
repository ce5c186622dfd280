"""Policy construction: a local Hugging Face causal LM, or the tiny random-init MoE preset.

Models are always built outside `deepspeed.zero.Init`: constructing Qwen3-MoE inside it leaves the
stacked expert weights uninitialised (see NOTES.md); DeepSpeed partitions them at `initialize`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig

from workers.rl.spec import ModelSpec, TinyMoeSpec

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelDirError(FileNotFoundError):
    """A model directory that cannot be loaded; the message says what is missing."""


def check_model_dir(path: str | Path) -> Path:
    """Fail early, with the missing file named, instead of deep inside `from_pretrained`."""
    p = Path(path)
    if not p.is_dir():
        raise ModelDirError(f"model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"model directory {p} has no config.json")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelDirError(f"model directory {p} has no weights (expected one of {WEIGHT_FILES})")
    return p


def tiny_moe_config(
    preset: TinyMoeSpec, vocab_size: int, pad_id: int, eos_id: int, aux_coef: float
) -> Qwen3MoeConfig:
    # head_dim is accepted (and used) at runtime; transformers' typed signature leaves it out.
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=4 * preset.hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        num_experts=preset.num_experts,
        num_experts_per_tok=preset.experts_per_token,
        moe_intermediate_size=preset.moe_intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
        norm_topk_prob=True,
        router_aux_loss_coef=aux_coef,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )


def build_policy(spec: ModelSpec, vocab_size: int, pad_id: int, eos_id: int) -> PreTrainedModel:
    """Same weights on every rank: the preset is seeded, a directory is read from disk.
    With `spec.lora` the model comes back wrapped in fresh peft adapters, the base frozen."""
    if spec.source == "path":
        assert spec.path is not None
        path = check_model_dir(spec.path)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
    else:
        cfg = tiny_moe_config(spec.preset, vocab_size, pad_id, eos_id, spec.router_aux_loss_coef)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config.use_cache = False
    if spec.lora is not None:  # adapters only: see workers/rl/lora.py
        from workers.rl.lora import apply_lora

        base = spec.model_dump(exclude={"lora"})
        # A PeftModel forwards attribute access (config, generate, ...) to the model it wraps.
        return apply_lora(model, spec.lora, base)  # type: ignore[return-value]
    return model


def is_moe(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "num_experts", 0)) and hasattr(cfg, "num_experts_per_tok")
