"""Atomic, resumable checkpoints.

Layout of one checkpoint, `<dir>/step-000040/`:
  hf/          the policy + tokenizer in Hugging Face format (loadable by any tool), and
               prompt_format.json (how the policy saw its prompts; see prompt_format.py);
               for a LoRA policy the merged model, plus hf/adapter/ (peft format + base.json)
  ds/          DeepSpeed state: model, optimizer and LR-scheduler partitions of every rank
               (a LoRA policy's: adapters only, the frozen base is rebuilt from the spec)
  rng-rank<r>.pt   python/numpy/torch RNG states of rank r
  rank<r>.json     rank r's own loop state (its curriculum sampler: data position, pass rates)
  warm/        only for a run whose RL phase needs its warm start beyond the policy (a KL/DPO
               reference, a LoRA policy's frozen base): the model RL started from, so a resume
               in a fresh folder rebuilds them from it (resume.restore_phases), not from hf/
  state.json   step, data cursor, NaN streak, last metrics (written last)

All ranks write into `.tmp-step-000040/`; rank 0 renames it into place once everyone is done, so
a `step-*` directory is always complete, whatever moment the run is killed at.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from workers.rl import lora
from workers.rl import prompt_format as prompt_formats
from workers.rl.prompt_format import PromptFormat

if TYPE_CHECKING:  # transformers is imported only by whoever builds the model
    from transformers import PreTrainedModel

STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_RE.match(p.name)) and (p / "state.json").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_hf(module: PreTrainedModel, tokenizer, out: Path, zero_stage: int,
            prompt_format: PromptFormat | None = None) -> None:
    """Collective under ZeRO-3 (parameters are gathered); rank 0 writes. `prompt_format`:
    how the policy saw its prompts, recorded beside the weights for whoever serves them."""
    import deepspeed

    from workers.rl import expert_parallel

    params = list(module.parameters())
    ctx = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
           if zero_stage == 3 else nullcontext())
    with ctx:
        # Expert-parallel: every rank takes part in gathering the experts; a normal HF model.
        full = expert_parallel.gathered_state_dict(module) if expert_parallel.is_sharded(
            module) else None
        if _rank() == 0 and full is not None:
            module.save_pretrained(out, state_dict={k: v.cpu() for k, v in full.items()},
                                   safe_serialization=True)
        elif _rank() == 0 and lora.is_lora(module):  # merged model + the adapter beside it
            merged = {k: v.cpu() for k, v in lora.merged_state(module).items()}
            lora.save_merged(module, out, merged)
            lora.save_adapter(module, out)
        elif _rank() == 0:
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            module.save_pretrained(out, state_dict=state, safe_serialization=True)
        if _rank() == 0:
            tokenizer.save_pretrained(out)
            if prompt_format is not None:
                prompt_formats.write(out, prompt_format)


def save_hf_atomic(module, tokenizer, out: Path, zero_stage: int,
                   prompt_format: PromptFormat | None = None) -> None:
    tmp = out.with_name(f".tmp-{out.name}")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    save_hf(module, tokenizer, tmp, zero_stage, prompt_format)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    _barrier()


def link_or_copy(src: str, dst: str) -> str:
    """A hard link (no extra disk for the model) on the same filesystem, else a copy. Safe
    to share: a finished phase folder is only ever replaced whole, never written in place."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def save(
    engine,
    tokenizer,
    root: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    zero_stage: int,
    rank_state: dict[str, Any] | None = None,
    prompt_format: PromptFormat | None = None,
    warm: Path | None = None,
) -> Path:
    """Collective: every rank must call it with the same step. ``warm``: the warm-start
    folder RL started from, carried as ``warm/`` (hard links where possible) when the RL phase
    needs it beyond the policy."""
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    # A LoRA policy's frozen base is rebuilt from the spec on resume: only adapters (and
    # their optimizer state) go into ds/.
    engine.save_checkpoint(str(tmp), tag="ds", save_latest=False,
                           exclude_frozen_parameters=lora.is_lora(engine.module))
    save_hf(engine.module, tokenizer, tmp / "hf", zero_stage, prompt_format)
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank_state is not None:
        (tmp / f"rank{rank}.json").write_text(json.dumps(rank_state, sort_keys=True))
    if rank == 0 and warm is not None:
        shutil.copytree(warm, tmp / "warm", copy_function=link_or_copy)
    _barrier()
    if rank == 0:
        with (tmp / "state.json").open("w") as f:
            json.dump({"step": step, **state}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(engine, path: Path) -> dict[str, Any]:
    """Restore engine (model, optimizer, scheduler) and this rank's RNG; return state.json."""
    load_path, _ = engine.load_checkpoint(
        str(path), tag="ds", load_optimizer_states=True, load_lr_scheduler_states=True,
        load_module_strict=not lora.is_lora(engine.module),
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
    rng_file = path / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "state.json").read_text())


def load_rank_state(path: Path) -> dict[str, Any] | None:
    """This rank's own loop state, or None for a checkpoint written without one."""
    f = path / f"rank{_rank()}.json"
    return json.loads(f.read_text()) if f.is_file() else None
