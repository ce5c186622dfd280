"""The run config's `data` (store-backed task records) and `rollout.backend = "vllm"` wiring."""

import pytest
import torch

from tests.skips import host_reason
from workers.rl.datacache import write_shards
from workers.rl.objectives import build_objective
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import SpecError, parse_spec
from workers.rl.trainer import train
from workers.rl.vllm_rollout import VllmUnavailable
from workers.storage import open_store

from .test_rl_trainer import tiny_spec


class Recording:
    """The arithmetic objective, remembering every prompt its reward scores."""

    def __init__(self) -> None:
        base = build_objective(parse_spec({}).task)
        self.train, self.eval, self._base = base.train, base.eval, base
        self.scored: set[str] = set()

    def reward(self, examples, completions):
        self.scored.update(e.prompt for e in examples)
        return self._base.reward(examples, completions)

    def corpus(self) -> list[str]:
        return self._base.corpus()


def test_training_prompts_come_from_store_records_through_the_cache(tmp_path, monkeypatch):
    root = tmp_path / "task-store"
    root.mkdir()
    monkeypatch.setenv("OBJECT_STORE_URL", root.as_uri())
    store = open_store(root.as_uri())
    # Subtraction problems: the built-in objective (addition) never shows a '-' prompt.
    records = [{"prompt": f"{a}-{b}=", "reference": str(a - b)}
               for a in range(10) for b in range(10)]
    source = write_shards(store, "tasks/sub", records, shard_records=25)
    spec = tiny_spec(tmp_path, data={"source": source, "disk_dir": str(tmp_path / "cache")},
                     sft={"steps": 2}, trainer={"steps": 3}, checkpoint={"every": 0})
    objective = Recording()
    train(spec, JsonlSink(tmp_path / "m.jsonl"), objective=objective)

    record_prompts = {r["prompt"] for r in records}
    eval_prompts = {e.prompt for e in objective.eval}
    assert objective.scored & record_prompts, "no training prompt came from the records"
    assert objective.scored <= record_prompts | eval_prompts
    assert not objective.scored & {e.prompt for e in objective.train}, \
        "built-in training prompts leaked"

    steps = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert len(steps) == 3
    for key in ("data/hit_rate_memory", "data/hit_rate_disk", "data/hit_rate_store",
                "data/wait_s"):
        assert key in steps[-1], key
    # 100 records in 4 shards: the tokenizer corpus read them all, so training hits memory.
    assert steps[-1]["data/hit_rate_memory"] > 0.5
    assert any((tmp_path / "cache").iterdir()), "the disk tier kept nothing"


def test_a_bad_data_source_is_refused_by_the_spec():
    with pytest.raises(SpecError, match="data"):
        parse_spec({"data": {"source": "/not/a/uri"}})
    with pytest.raises(SpecError, match="max_async_steps"):
        parse_spec({"rollout": {"backend": "vllm"}, "trainer": {"max_async_steps": 1}})


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason=host_reason("on a CUDA machine the backend can start"))
def test_vllm_backend_without_a_gpu_fails_before_sft_naming_the_extra(tmp_path):
    spec = tiny_spec(tmp_path, rollout={"backend": "vllm"})
    with pytest.raises(VllmUnavailable, match=r"pip install \.\[gpu\]"):
        train(spec)
    assert not (tmp_path / "ckpt" / "sft").exists()
