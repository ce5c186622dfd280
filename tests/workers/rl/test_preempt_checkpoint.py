"""Preemption by checkpoint in the engine (no Django): a run whose reporter says "preempted"
writes a checkpoint of its last completed step through the periodic path and stops; resuming
from it continues at the next step as the uninterrupted run does. A cancel or a lost lease
stops without writing one. On two ranks, the stop only rank 0's reporter sees is agreed by
both, and both write their part of the checkpoint."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from tests.workers.rl.test_rl_trainer import tiny_spec
from workers.reporting import Stopped
from workers.rl import checkpoint as ckpt
from workers.rl.distributed import free_port
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.trainer import RunResult, train

STEPS = 5
LOSS_TOLERANCE = 1e-6  # CPU fp32 with fixed seeds replays exactly in one process
Record = dict[str, Any]


class StopWhen(JsonlSink):
    """A reporter whose run is told to stop once it has written a record ``when`` picks: as
    a preemption (``preempt``: checkpoint, then stop) or as a cancel / lost lease."""

    def __init__(self, path: Path, when: Callable[[Record], bool], preempt: bool) -> None:
        super().__init__(path)
        self.when, self.preempt, self.stop = when, preempt, False

    def _write(self, record: Record) -> None:
        super()._write(record)
        self.stop = self.stop or self.when(record)

    def should_stop(self) -> bool:
        return self.stop

    def preempted(self) -> bool:
        return self.stop and self.preempt


def after_step(k: int) -> Callable[[Record], bool]:
    """True once RL step ``k`` is logged (its metrics carry the loss)."""
    return lambda r: r["kind"] == "metrics" and r["step"] == k and "loss" in r["metrics"]


def spec_at(folder: Path) -> Any:
    # A checkpoint interval longer than the run: only a preemption writes one.
    return tiny_spec(folder, trainer={"steps": STEPS}, checkpoint={"every": 100, "keep": 2})


def rl_steps(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path) if r["kind"] == "metrics"
            and "loss" in r["metrics"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    folder = tmp_path_factory.mktemp("full")
    return train(spec_at(folder), JsonlSink(folder / "m.jsonl"))


def assert_replays(result: RunResult, full: RunResult, steps: range) -> None:
    """The resumed steps' losses are the uninterrupted run's: the checkpoint held all the
    state (weights, optimizer, schedule, RNG, data position)."""
    assert sorted(result.losses) == list(steps)
    for s in steps:
        assert abs(result.losses[s] - full.losses[s]) <= LOSS_TOLERANCE, s


def test_a_preempted_run_checkpoints_its_last_step_and_resumes_after_it(
        tmp_path: Path, uninterrupted: RunResult) -> None:
    spec = spec_at(tmp_path)
    with pytest.raises(Stopped, match="preempted after step 3"):
        train(spec, StopWhen(tmp_path / "a.jsonl", after_step(3), preempt=True))
    root = tmp_path / "ckpt"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-000003"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    state = json.loads((root / "step-000003" / "state.json").read_text())
    assert state["step"] == 3 and state["cursor"] == 3 * 2
    first = read_jsonl(tmp_path / "a.jsonl")
    assert [(r["step"], Path(r["uri"]).parent.name) for r in first
            if r["kind"] == "checkpoint"] == [(3, "step-000003")]
    assert rl_steps(tmp_path / "a.jsonl") == [1, 2, 3]

    resumed = train(spec, JsonlSink(tmp_path / "b.jsonl"), resume=True)
    assert resumed.steps == STEPS
    # contiguous: the second attempt starts at step 4 and nothing is trained twice
    assert rl_steps(tmp_path / "a.jsonl") + rl_steps(tmp_path / "b.jsonl") == [1, 2, 3, 4, 5]
    assert_replays(resumed, uninterrupted, range(4, STEPS + 1))


def test_a_cancel_or_lost_lease_stops_without_writing_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(Stopped, match="canceled or its lease lost"):
        train(spec_at(tmp_path), StopWhen(tmp_path / "a.jsonl", after_step(2), preempt=False))
    assert ckpt.list_checkpoints(tmp_path / "ckpt") == []
    assert not [r for r in read_jsonl(tmp_path / "a.jsonl") if r["kind"] == "checkpoint"]
    assert rl_steps(tmp_path / "a.jsonl") == [1, 2]


def test_warm_start_preemptions(tmp_path: Path, uninterrupted: RunResult) -> None:
    # During SFT there is no resumable state: the run stops with nothing written.
    sft_step_0 = tmp_path / "during"
    with pytest.raises(Stopped, match="during SFT at step 1"):
        train(spec_at(sft_step_0), StopWhen(
            sft_step_0 / "a.jsonl",
            lambda r: r["kind"] == "metrics" and "sft/loss" in r["metrics"], preempt=True))
    assert ckpt.list_checkpoints(sft_step_0 / "ckpt") == []
    assert not (sft_step_0 / "ckpt" / "sft").exists()
    # Once SFT is done, a preemption before RL step 1 keeps it as a checkpoint at step 0...
    after = tmp_path / "after"
    with pytest.raises(Stopped, match="before RL step 1"):
        train(spec_at(after), StopWhen(
            after / "a.jsonl",
            lambda r: r["kind"] == "event" and "SFT warm start done" in r["message"],
            preempt=True))
    assert [p.name for p in ckpt.list_checkpoints(after / "ckpt")] == ["step-000000"]
    assert rl_steps(after / "a.jsonl") == []
    # ...which resumes into RL step 1 as the uninterrupted run went on.
    resumed = train(spec_at(after), JsonlSink(after / "b.jsonl"), resume=True)
    assert rl_steps(after / "b.jsonl") == [1, 2, 3, 4, 5]
    assert_replays(resumed, uninterrupted, range(1, STEPS + 1))


def _rank(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of a two-rank run whose rank-0 reporter says "preempted" after step 2;
    writes what stopped it, then leaves without C++ teardown (see workers.rl.__main__)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch

    torch.set_num_threads(1)
    root = Path(folder)
    spec = tiny_spec(root, trainer={"steps": STEPS, "prompts_per_step": 2, "zero_stage": 2},
                     checkpoint={"every": 100})
    try:
        train(spec, StopWhen(root / "a.jsonl", after_step(2), preempt=True))
        outcome = "finished"
    except Stopped as exc:
        outcome = f"stopped: {exc}"
    (root / f"rank{rank}.txt").write_text(outcome)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_two_ranks_agree_on_the_stop_and_write_one_checkpoint(tmp_path: Path) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    # Rank 1's reporter never stops: without rank 0's decision broadcast it would go on to
    # step 3 and wait there for rank 0 forever (the test would time out).
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == \
            "stopped: preempted after step 2; its checkpoint is written"
    root = tmp_path / "ckpt"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-000002"]
    last = root / "step-000002"
    for rank in (0, 1):  # each rank's own RNG, data position and optimizer partition
        assert (last / f"rng-rank{rank}.pt").is_file()
        assert json.loads((last / f"rank{rank}.json").read_text())["sampler"]["cursor"] == 2
    assert len(list((last / "ds").glob("*optim_states.pt"))) == 2
    assert rl_steps(tmp_path / "a.jsonl") == [1, 2]
