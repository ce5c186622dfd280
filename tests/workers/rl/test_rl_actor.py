"""Async actor-learner and curriculum: the pure parts against hand-computed values, the producer
with a real tiny policy, and in-process runs (async with staleness metrics; a resumed run whose
curriculum buffer equals the uninterrupted run's)."""

import json
import shutil
import time

import pytest
import torch

from workers.rl import checkpoint as ckpt
from workers.rl.actor import (
    AsyncActor,
    AsyncStall,
    Group,
    Producer,
    WeightStore,
    lag_histogram,
    merge,
    take_fresh,
)
from workers.rl.curriculum import PassRates, TaskSampler, group_pass_rate, in_band, is_uniform
from workers.rl.objectives import Example, build_objective
from workers.rl.rollout import HFRollout, RolloutBatch
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import CurriculumSpec, parse_spec
from workers.rl.trainer import train

TINY = {"preset": {"num_layers": 2, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


def examples(n):
    return [Example(prompt=f"p{i}", reference=str(i)) for i in range(n)]


def identity_perm(epoch, n):
    return list(range(n))


# ---- curriculum: pure parts ----------------------------------------------------------------


def test_uniform_groups_and_pass_rates():
    assert is_uniform([1.0, 1.0, 1.0]) and is_uniform([0.0, 0.0])
    assert not is_uniform([0.0, 1.0, 0.0])
    assert group_pass_rate([1.0, 0.0, 0.7, 0.2], 0.5) == 0.5
    buf = PassRates(alpha=0.5)
    buf.update("a", 1.0)  # first observation is taken as is
    assert buf.rate("a") == 1.0
    buf.update("a", 0.0)  # 1.0 + 0.5 * (0.0 - 1.0)
    assert buf.rate("a") == 0.5
    buf.update("a", 0.25)  # 0.5 + 0.5 * (0.25 - 0.5)
    assert buf.rate("a") == 0.375
    assert buf.rate("a", min_seen=4) is None and buf.rate("b") is None
    assert buf.state_dict() == {"a": [3, 0.375]}
    assert in_band(None, 0.2, 0.8) and in_band(0.2, 0.2, 0.8) and not in_band(0.9, 0.2, 0.8)


def test_sampler_skips_tasks_outside_the_band_and_round_trips_its_state():
    spec = CurriculumSpec(band_low=0.2, band_high=0.8, explore=0.0)
    s = TaskSampler(examples(6), spec, seed=0, rank=0, world=1, permutation=identity_perm)
    s.record(examples(6)[1], [1.0, 1.0, 1.0, 1.0])  # too easy: pass rate 1.0
    s.record(examples(6)[2], [0.0, 0.0, 0.0, 0.0])  # too hard: 0.0
    s.record(examples(6)[3], [1.0, 0.0, 0.0, 0.0])  # 0.25: in the band
    assert [e.prompt for e in s.take(3)] == ["p0", "p3", "p4"]
    assert s.band_skipped == 2 and s.cursor == 5
    state = json.loads(json.dumps(s.state_dict()))
    t = TaskSampler(examples(6), spec, seed=0, rank=0, world=1, permutation=identity_perm)
    t.load_state_dict(state)
    assert t.state_dict() == s.state_dict()
    # next epoch wraps around and skips p1 and p2 again
    assert [e.prompt for e in t.take(3)] == ["p5", "p0", "p3"]
    assert t.band_skipped == 4


def test_sampler_ignores_a_band_nothing_is_in():
    spec = CurriculumSpec(band_low=0.4, band_high=0.6, explore=0.0)
    s = TaskSampler(examples(3), spec, seed=0, rank=0, world=1, permutation=identity_perm)
    for ex in examples(3):
        s.record(ex, [1.0, 1.0])
    assert len(s.take(2)) == 2  # terminates: after a full pass the band is waived


def test_ranks_read_disjoint_interleaved_streams():
    spec = CurriculumSpec()
    r0 = TaskSampler(examples(6), spec, 0, 0, 2, identity_perm)
    r1 = TaskSampler(examples(6), spec, 0, 1, 2, identity_perm)
    assert [e.prompt for e in r0.take(3)] == ["p0", "p2", "p4"]
    assert [e.prompt for e in r1.take(3)] == ["p1", "p3", "p5"]


# ---- actor: pure parts ---------------------------------------------------------------------


def group_with_version(v):
    empty = RolloutBatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                         torch.zeros(1, 1), torch.zeros(1, 1), [""])
    return Group(Example("p", "r"), empty, [0.0], {}, v)


def test_staleness_bound_drops_old_groups_and_histograms_lags():
    pool = [group_with_version(v) for v in (4, 2, 1, 3)]
    fresh, dropped = take_fresh(pool, step=4, bound=2)  # lags 0, 2, 3, 1
    assert [g.version for g in fresh] == [4, 2, 3] and dropped == 1
    assert lag_histogram([4, 2, 3, 3], step=4, bound=2, group=8) == {
        "async/lag0": 8.0, "async/lag1": 16.0, "async/lag2": 8.0}
    with pytest.raises(AssertionError, match="lag outside 0..2"):
        lag_histogram([1], step=4, bound=2, group=8)


def test_merge_keeps_left_padded_prompts_and_right_padded_completions():
    a = RolloutBatch(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]),
                     torch.tensor([[1]]), torch.tensor([[-0.5]]), ["x"])
    b = RolloutBatch(torch.tensor([[8]]), torch.tensor([[1]]), torch.tensor([[9, 1]]),
                     torch.tensor([[1, 1]]), torch.tensor([[-0.25, -0.75]]), ["y"])
    m = merge([a, b], pad_id=0)
    assert m.prompt_ids.tolist() == [[5, 6], [0, 8]]
    assert m.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert m.completion_ids.tolist() == [[7, 0], [9, 1]]
    assert m.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert m.logprobs.tolist() == [[-0.5, 0.0], [-0.25, -0.75]] and m.texts == ["x", "y"]


def test_weight_hand_off_is_versioned_and_times_out():
    store = WeightStore()
    t0 = time.monotonic()
    with pytest.raises(AsyncStall, match="version >= 0; the learner last published version -1"):
        store.wait(0, timeout=0.05)
    assert time.monotonic() - t0 < 5
    store.publish(3, {"w": torch.ones(1)})
    version, state = store.wait(2, timeout=0.05)
    assert version == 3 and state["w"].item() == 1.0
    with pytest.raises(AsyncStall, match="version >= 4"):
        store.wait(4, timeout=0.05)


# ---- producer and actor with a real tiny policy ---------------------------------------------


class ParityObjective:
    """The arithmetic prompts, rewarded 1 when a completion's length is even: sampled groups
    from a random policy are mixed, so the filter keeps most of them."""

    def __init__(self):
        base = build_objective(parse_spec({}).task)
        self.train, self.eval, self._base = base.train, base.eval, base

    def corpus(self):
        return self._base.corpus()

    def reward(self, exs, completions):
        r = [float(len(c) % 2 == 0) for c in completions]
        return r, {"parity": r}


def make_producer(spec, objective, tokenizer, per_rank=3, bound=0):
    sampler = TaskSampler(objective.train, spec.curriculum, 0, 0, 1,
                          lambda e, n: torch.randperm(n, generator=torch.Generator()
                                                      .manual_seed(e)).tolist())

    def gen(*key):
        return torch.Generator().manual_seed(hash(key) & 0xFFFF_FFFF)

    return Producer(spec, objective, sampler, tokenizer.pad_token_id, per_rank, 0, gen, bound)


def test_producer_replaces_uniform_groups_by_sampling_more(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 4, "max_new_tokens": 4},
                       "curriculum": {"filter_uniform": True, "max_rounds": 6}})
    backend = HFRollout(tiny_model, tokenizer)
    # Exact match from a random policy: every group is all-zero, so all rounds are used and
    # the batch falls back to (counted) uniform groups.
    objective = build_objective(spec.task)
    sb = make_producer(spec, objective, tokenizer).produce(5, lambda: (5, backend))
    assert sb.counts["filter/rounds"] == 6 and sb.counts["filter/fallback_groups"] == 3
    assert sb.counts["filter/uniform_groups"] >= 3
    assert sb.batch.completion_ids.shape[0] == 12 and sb.versions == [5, 5, 5]
    assert sb.counts["curriculum/tracked_tasks"] == sb.sampler_state["cursor"]
    # A reward that splits groups: whatever the batch holds is informative.
    sb = make_producer(spec, ParityObjective(), tokenizer).produce(0, lambda: (0, backend))
    groups = sb.rewards.view(-1, 4)
    assert sb.counts["filter/fallback_groups"] == 0
    assert all(not is_uniform(g.tolist()) for g in groups)
    assert sb.sampler_state["cursor"] == 3 + sb.counts["filter/uniform_groups"]


def test_async_actor_runs_ahead_within_the_bound(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 3}})
    producer = make_producer(spec, build_objective(spec.task), tokenizer, per_rank=2, bound=2)
    store = WeightStore()
    store.publish(0, {k: v.clone() for k, v in tiny_model.state_dict().items()})
    actor = AsyncActor(producer, tiny_model, HFRollout(tiny_model, tokenizer), store, 0, 5,
                       bound=2, timeout=5.0)
    actor.start()
    try:
        # Without new weights the actor can produce steps 0..2 (version 0, lag <= 2) only.
        got = [actor.get(s) for s in range(3)]
        assert [b.versions for b in got] == [[0, 0]] * 3
        time.sleep(0.3)
        assert actor.batches.empty()  # step 3 needs version >= 1: the actor waits
        store.publish(2, {k: v.clone() for k, v in tiny_model.state_dict().items()})
        assert actor.get(3).versions == [2, 2] and actor.get(4).versions == [2, 2]
    finally:
        actor.stop()
    assert not actor.is_alive()


def test_a_stalled_weight_sync_fails_loudly(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 2}})
    producer = make_producer(spec, build_objective(spec.task), tokenizer, per_rank=1, bound=1)
    store = WeightStore()
    store.publish(0, {k: v.clone() for k, v in tiny_model.state_dict().items()})
    actor = AsyncActor(producer, tiny_model, HFRollout(tiny_model, tokenizer), store, 0, 4,
                       bound=1, timeout=1.0)
    actor.start()
    try:
        actor.get(0)
        actor.get(1)
        # The learner "forgot" to publish version 1: the actor's wait times out, and the error
        # reaches the learner instead of a hang.
        with pytest.raises(AsyncStall, match="weights of version >= 1"):
            actor.get(2)
    finally:
        actor.stop()


# ---- whole runs ----------------------------------------------------------------------------


def run_spec(tmp_path, name, **sections):
    data = {
        "model": TINY,
        "sft": {"steps": 3, "batch_size": 8},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": 4, "prompts_per_step": 2, "micro_batch_size": 8,
                    "zero_stage": 2},
        "checkpoint": {"dir": str(tmp_path / name), "every": 2, "keep": 2,
                       "save_final": False},
        "output": {"stdout": False},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return parse_spec(data)


def test_async_run_reports_staleness_and_idle_fractions(tmp_path):
    spec = run_spec(tmp_path, "async", trainer={"max_async_steps": 2, "steps": 5},
                    curriculum={"filter_uniform": True, "max_rounds": 2},
                    algorithm={"importance": "tis"})
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"), objective=ParityObjective())
    assert sorted(result.losses) == [1, 2, 3, 4, 5]
    steps = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "loss" in r["metrics"]]
    lags = [[m[f"async/lag{i}"] for i in range(3)] for m in steps]
    assert all(sum(row) == 2 * 4 for row in lags)  # every trained sample has a lag in 0..2
    assert sum(row[1] + row[2] for row in lags) > 0  # generation did run ahead of training
    for m in steps:
        assert 0.0 <= m["async/learner_idle"] <= 1.0 and 0.0 <= m["async/generator_idle"] <= 1.0
        assert m["async/stale_dropped"] >= 0 and m["filter/rounds"] >= 1
    # The parity reward splits most groups; the ones it does not are counted, not trained on.
    assert sum(m["filter/uniform_groups"] for m in steps) >= 0
    assert all(m["filter/fallback_groups"] <= 2 for m in steps)


def test_resume_restores_the_curriculum_buffer_exactly(tmp_path):
    cur = {"filter_uniform": True, "max_rounds": 3, "band_low": 0.1, "band_high": 0.9,
           "explore": 0.3}
    spec = run_spec(tmp_path, "full", curriculum=cur)
    full = train(spec, objective=ParityObjective())
    assert full.curriculum["buffer"], "the buffer holds pass rates"
    # The same run as if killed after its step-2 checkpoint: step 4 is gone.
    shutil.copytree(tmp_path / "full", tmp_path / "part")
    shutil.rmtree(tmp_path / "part" / "step-000004")
    saved = json.loads((tmp_path / "part" / "step-000002" / "rank0.json").read_text())
    assert saved["sampler"]["cursor"] < full.curriculum["cursor"]
    part = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"dir": str(tmp_path / "part")})})
    resumed = train(part, resume=True, objective=ParityObjective())
    assert resumed.curriculum == full.curriculum  # buffer, data position and counters
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(full.losses[step], abs=1e-6)
    last = ckpt.latest(tmp_path / "part")
    assert json.loads((last / "rank0.json").read_text())["sampler"] == json.loads(
        json.dumps(full.curriculum))
