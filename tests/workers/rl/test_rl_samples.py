"""RL samples: which sequences of a step are reported, what each row holds, the byte cap, and
a real training run reporting them at the configured interval."""

from __future__ import annotations

import torch

from workers.rl.samples import TRUNCATED, clip_text, finish_reason, pick_samples, reports_at
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import SamplesSpec
from workers.rl.trainer import train

from .test_rl_trainer import tiny_spec


def test_clip_text_caps_utf8_bytes_without_splitting_a_character() -> None:
    assert clip_text("short", 100) == "short"
    clipped = clip_text("é" * 100, 40)  # 200 bytes
    assert len(clipped.encode()) <= 40 and clipped.endswith(TRUNCATED)
    assert set(clipped[: -len(TRUNCATED)]) == {"é"}
    assert len(clip_text("x" * 50, 5).encode()) <= 5


def test_finish_reasons() -> None:
    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, eos], [5, 6, 7], [5, pad, pad], [eos, pad, pad]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]])
    # eos at the budget, budget used up, a stop string before the budget, eos at once.
    assert finish_reason(mask, ids, eos, 3, episode=False) == ["stop", "length", "stop", "stop"]
    assert finish_reason(mask, ids, eos, 3, episode=True) == ["episode"] * 4


def test_pick_samples_spreads_over_the_batch_and_shares_the_byte_budget() -> None:
    n = 8  # two groups of four
    rows = pick_samples(
        SamplesSpec(per_step=4, max_bytes=400),
        prompts=[f"prompt {i // 4}" for i in range(n)], texts=[f"c{i}" for i in range(n)],
        rewards=[float(i % 2) for i in range(n)],
        components={"exact": [float(i % 2) for i in range(n)]},
        advantages=[0.5 if i % 2 else -0.5 for i in range(n)],
        versions=[3] * 4 + [4] * 4, reasons=["stop"] * n)
    assert [r["completion"] for r in rows] == ["c0", "c2", "c4", "c6"]  # i * n // k
    assert rows[2] == {"prompt": "prompt 1", "completion": "c4", "reward": 0.0,
                       "reward_components": {"exact": 0.0}, "advantage": -0.5,
                       "weight_version": 4, "finish_reason": "stop"}
    # 100 bytes per row: a short prompt leaves the completion the rest.
    long = pick_samples(SamplesSpec(per_step=2, max_bytes=256), prompts=["p", "p" * 500],
                        texts=["c" * 500, "c" * 500], rewards=[0, 0], components={},
                        advantages=[0, 0], versions=[0, 0], reasons=["length"] * 2)
    assert long[0]["prompt"] == "p" and len(long[0]["completion"].encode()) == 127
    assert sum(len(r["prompt"].encode()) + len(r["completion"].encode()) for r in long) <= 256
    assert pick_samples(SamplesSpec(per_step=0), prompts=["p"], texts=["c"], rewards=[0],
                        components={}, advantages=[0], versions=[0], reasons=["stop"]) == []
    assert reports_at(SamplesSpec(every=2), 4) and not reports_at(SamplesSpec(every=2), 3)
    assert not reports_at(SamplesSpec(per_step=0), 2)


def test_a_training_run_reports_samples_every_n_steps(tmp_path) -> None:
    spec = tiny_spec(tmp_path, samples={"per_step": 3, "every": 2},
                     checkpoint={"every": 0})
    sink = JsonlSink(tmp_path / "m.jsonl")
    train(spec, sink)
    records = [r for r in read_jsonl(tmp_path / "m.jsonl") if r["kind"] == "samples"]
    assert [r["step"] for r in records] == [2, 4]
    metrics = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
               if r["kind"] == "metrics" and "reward_mean" in r["metrics"]}
    for record in records:
        rows = record["samples"]
        assert len(rows) == 3
        for row in rows:
            assert set(row) == {"prompt", "completion", "reward", "reward_components",
                                "advantage", "weight_version", "finish_reason"}
            assert row["prompt"].endswith("=")  # arithmetic prompts
            assert set(row["reward_components"]) == {"exact_match", "is_number"}
            assert row["reward"] == row["reward_components"]["exact_match"]
            assert row["finish_reason"] in ("stop", "length")
            # Synchronous: step n trains on samples of the weights after n - 1 updates.
            assert row["weight_version"] == record["step"] - 1
        # A group whose rewards are all equal has zero advantage under GRPO.
        assert all(abs(r["advantage"]) < 1e-4 for r in rows
                   if metrics[record["step"]]["reward_std"] == 0)
