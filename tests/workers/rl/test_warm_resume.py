"""A run with a warm start resumed in a fresh folder, as the platform does it (the step folder
is packed into the object store, unpacked into a new root, then resume.restore_phases): its KL
reference and a LoRA policy's frozen base are the warm-start model, not the checkpoint's
policy, so the resumed steps' losses are the uninterrupted run's (no Django)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.workers.rl.test_lora import PRESET
from tests.workers.rl.test_rl_trainer import tiny_spec
from workers.model_cache import fetch_tar, pack_checkpoint
from workers.rl import checkpoint as ckpt
from workers.rl.resume import restore_phases
from workers.rl.sinks import JsonlSink
from workers.rl.trainer import train
from workers.storage import LocalStore

STEPS, AT = 3, 1  # resume from the checkpoint of step 1
LOSS_TOLERANCE = 1e-6  # CPU fp32 with fixed seeds replays exactly in one process

CASES = {
    "kl": {"algorithm": {"kl_coef": 0.05}},
    "lora": {"model": {"preset": PRESET, "lora": {"r": 4, "alpha": 8}},
             "trainer": {"lr": 1e-2}},
}


def spec_at(root: Path, case: str, keep: int = 5) -> Any:
    sections = {k: dict(v) for k, v in CASES[case].items()}
    sections["trainer"] = {**sections.get("trainer", {}), "steps": STEPS}
    sections["checkpoint"] = {"every": 1, "keep": keep}
    return tiny_spec(root, **sections)  # SFT warm start: 3 steps


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_resumed_in_a_fresh_root_replays_the_uninterrupted_run(
        tmp_path: Path, case: str) -> None:
    full_dir = tmp_path / "full"
    full = train(spec_at(full_dir, case), JsonlSink(tmp_path / "full.jsonl"))
    step = ckpt.step_dir(full_dir / "ckpt", AT)
    assert (step / "warm" / "config.json").is_file()
    # hard-linked from the warm-start folder RL started from, not a second copy
    weights = next((step / "warm").glob("*.safetensors"))
    assert weights.stat().st_ino == (full_dir / "ckpt" / "sft" / weights.name).stat().st_ino

    store = LocalStore((tmp_path / "store").as_uri())
    uri = pack_checkpoint(store, step / "hf", "step.tar", tmp_path / "scratch")
    fresh = tmp_path / "fresh" / "ckpt"  # the next attempt's root: only the step folder
    fetch_tar(store, uri, fresh / step.name)
    assert (fresh / step.name / "warm" / "config.json").is_file()  # warm/ is in the tar
    spec = spec_at(tmp_path / "fresh", case)
    restore_phases(spec, fresh, fresh / step.name)
    resumed = train(spec, JsonlSink(tmp_path / "resumed.jsonl"), resume=True)
    assert sorted(resumed.losses) == list(range(AT + 1, STEPS + 1))
    for s in resumed.losses:
        assert abs(resumed.losses[s] - full.losses[s]) <= LOSS_TOLERANCE, (s, resumed.losses[s],
                                                                           full.losses[s])


def test_warm_is_carried_only_when_rl_needs_it_and_pruning_removes_it(tmp_path: Path) -> None:
    """A run whose RL phase uses only the policy restores from hf/ and carries no warm/; with
    keep = 1, pruned checkpoints go with their warm/ and leave the warm start intact."""
    train(tiny_spec(tmp_path / "plain", trainer={"steps": 2}), JsonlSink(tmp_path / "p.jsonl"))
    plain = ckpt.latest(tmp_path / "plain" / "ckpt")
    assert plain is not None and not (plain / "warm").exists()
    root = tmp_path / "kl" / "ckpt"
    spec = tiny_spec(tmp_path / "kl", trainer={"steps": 2}, algorithm={"kl_coef": 0.05},
                     checkpoint={"every": 1, "keep": 1})
    train(spec, JsonlSink(tmp_path / "k.jsonl"))
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-000002"]
    assert (root / "step-000002" / "warm" / "config.json").is_file()
    assert (root / "sft" / "config.json").is_file()
