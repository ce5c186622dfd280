"""The tiny-MoE preset as a Hugging Face folder, for runs that evaluate "the model a train run
on this environment would start from" without training one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.envs.adapter import as_objective
from workers.envs.load import load_environment
from workers.rl import prompt_format
from workers.rl.episodes import plays_episodes
from workers.rl.model import build_policy
from workers.rl.spec import DEFAULT_VOCAB_SIZE, ModelSpec, SpecError, TokenizerSpec
from workers.rl.tokenizer import train_bpe


def preset_model_dir(env_spec: dict[str, Any], spec: ModelSpec, tok_spec: TokenizerSpec,
                     resolve: Callable[[Any], Any], target: Path) -> Path:
    """Seeded random weights and a BPE tokenizer trained on the environment's tasks (what a
    train run on it starts from), saved under ``target``."""
    if tok_spec.source != "train":
        raise SpecError("the preset model has no tokenizer of its own: tokenizer.source must "
                        "be 'train'")
    objective = as_objective(load_environment(env_spec, resolve_dataset=resolve))
    tok = train_bpe(objective.corpus(), tok_spec.vocab_size or DEFAULT_VOCAB_SIZE)
    policy = build_policy(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    target.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(target)
    tok.save_pretrained(target)
    # The prompts a train run on it would see: raw text, as the engine records it.
    layout = "episode" if plays_episodes(objective) else "single_turn"
    prompt_format.write(target, prompt_format.PromptFormat(format="raw", layout=layout))
    return target
