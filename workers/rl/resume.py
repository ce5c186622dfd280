"""Resuming a train run on any host: which recorded checkpoint to start from, and how its
folder stands in for the warm-start phases it already contains. No torch: the adapter calls
this before the engine starts."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.protocol import CheckpointRef

# A periodic checkpoint holds the training state; the final export (``final.tar``) only the
# model, so it is never resumed from.
CHECKPOINT_NAME = re.compile(r"/step-\d+\.tar$")


def resume_point(checkpoints: Sequence[CheckpointRef]) -> CheckpointRef | None:
    """The run's last recorded checkpoint that holds training state (``step-N.tar``)."""
    for ckpt in reversed(checkpoints):
        if CHECKPOINT_NAME.search(ckpt.uri):
            return ckpt
    return None


def local_folder(root: Path, ckpt: CheckpointRef) -> Path:
    """Where the engine looks for the checkpoint of ``ckpt.step`` under its checkpoint root."""
    return root / f"step-{ckpt.step:06d}"


def restore_phases(spec: Any, root: Path, folder: Path) -> None:
    """Give the engine a finished folder for each warm-start phase so it does not train it
    again: the checkpoint's ``warm/`` (the model RL started from: its KL/DPO reference and a
    LoRA policy's frozen base are rebuilt from it), else ``hf/`` (an older checkpoint, or a
    run that needs only the policy, whose weights are then loaded from the checkpoint)."""
    source = folder / "warm" if (folder / "warm").is_dir() else folder / "hf"
    for phase, steps in (("sft", spec.sft.steps), ("preference", spec.preference.steps)):
        if steps and not (root / phase).exists():
            shutil.copytree(source, root / phase)
