"""The rollout actor in a child process (`trainer.async_actor = "process"`): the shared weight
store's versioning, a real spawned child sampling exactly what the inline producer samples with
the same weights, its failures reaching the learner, and whole runs."""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.workers.rl.test_rl_actor import ParityObjective, run_spec
from workers import threads
from workers.rl.actor import AsyncStall, Producer, RolloutSetup, Seeds
from workers.rl.curriculum import TaskSampler
from workers.rl.objectives import build_objective
from workers.rl.process_actor import ProcessRollouts, RolloutProcessFailed, SharedWeights
from workers.rl.rollout import HFRollout
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import ModelSpec, TinyMoeSpec, parse_spec
from workers.rl.trainer import train

MODEL = ModelSpec(preset=TinyMoeSpec(num_layers=2))


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the shared weight store ----------------------------------------------------------------


def test_shared_weights_are_versioned_checked_and_time_out():
    ctx = mp.get_context("spawn")
    w = SharedWeights({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}, ctx)
    loads: list[tuple[int, dict]] = []

    def load(version, state):
        loads.append((version, {k: v.clone() for k, v in state.items()}))

    t0 = time.monotonic()
    with pytest.raises(AsyncStall, match="version >= 0; the learner last published version -1"):
        w.read(0, -1, 0.2, load)
    assert time.monotonic() - t0 < 5 and not loads
    w.write(3, {"a": torch.ones(2, 3), "b": torch.arange(4)})
    assert w.read(2, -1, 1.0, load) == 3
    assert loads[0][0] == 3 and loads[0][1]["a"].sum() == 6 and loads[0][1]["b"].tolist() == [
        0, 1, 2, 3]
    assert w.read(3, 3, 1.0, load) == 3 and len(loads) == 1  # held already: not copied again
    with pytest.raises(AsyncStall, match="version >= 4"):
        w.read(4, 3, 0.2, load)
    with pytest.raises(ValueError, match=r"version 4 does not fit.*missing \['b'\], "
                                         r"unexpected \['c'\]"):
        w.write(4, {"a": torch.ones(2, 3), "c": torch.arange(4)})
    with pytest.raises(ValueError, match=r"a: \(3, 2\) float32 where the layout has \(2, 3\)"):
        w.write(4, {"a": torch.ones(3, 2), "b": torch.arange(4)})
    assert w.read(0, -1, 1.0, load) == 3  # a refused write changed nothing
    with pytest.raises(AsyncStall, match="the learner process is gone"):
        w.read(9, 3, 5.0, load, alive=lambda: False)
    w.close()
    with pytest.raises(AsyncStall, match="closed"):
        w.read(9, 3, 5.0, load)


# ---- a real rollout process -----------------------------------------------------------------


def producer_for(spec, objective, tokenizer, per_rank, bound):
    """A producer that pickles (its seeds and curriculum permutation are plain data)."""
    seeds = Seeds(0)
    sampler = TaskSampler(objective.train, spec.curriculum, 0, 0, 1, seeds.permutation)
    return Producer(spec, objective, sampler, tokenizer.pad_token_id, per_rank, 0,
                    seeds.generator, bound)


def setup_for(producer, tokenizer, total, bound=0, timeout=30.0):
    return RolloutSetup(producer=producer, model_spec=MODEL, tokenizer=tokenizer, start=0,
                        total=total, bound=bound, timeout=timeout, bf16=False, aux_free=False)


def nudged(model, step):
    """The learner's 'update': every float weight moved by a seeded amount."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return state_of(model)


def test_the_rollout_process_samples_exactly_what_the_inline_producer_does(tokenizer,
                                                                           tiny_model,
                                                                           monkeypatch):
    monkeypatch.setenv("CRUCIBLE_THREADS", "1")  # one thread each side: the same kernels
    spec = parse_spec({"rollout": {"group_size": 3, "max_new_tokens": 4}})
    objective = ParityObjective()
    remote = producer_for(spec, objective, tokenizer, per_rank=2, bound=0)
    local = producer_for(spec, objective, tokenizer, per_rank=2, bound=0)
    tiny_model.eval()
    backend = HFRollout(tiny_model, tokenizer)
    # Bound 0: step n waits for version n exactly, so what the child samples is determined.
    before = torch.get_num_threads()
    source = ProcessRollouts().start(setup_for(remote, tokenizer, 3), state_of(tiny_model))
    assert source.child_threads == torch.get_num_threads() == 1
    try:
        for step in range(3):
            if step:
                source.publish(step, nudged(tiny_model, step))
            got = source.get(step)
            want = local.produce(step, lambda s=step: (s, backend))
            assert got.versions == want.versions == [step, step]
            assert torch.equal(got.batch.completion_ids, want.batch.completion_ids)
            assert torch.equal(got.batch.logprobs, want.batch.logprobs)
            assert torch.equal(got.rewards, want.rewards) and got.batch.texts == want.batch.texts
            assert got.sampler_state == want.sampler_state
            assert got.gen_s > 0
    finally:
        source.stop()
    assert not source.proc.is_alive() and not multiprocessing.active_children()
    assert torch.get_num_threads() == before  # the learner's threads are given back


class FailingObjective(ParityObjective):
    def reward(self, exs, completions):
        raise ZeroDivisionError("the grader divided by zero")


def test_an_error_in_the_rollout_process_reaches_the_learner_with_its_traceback(tokenizer,
                                                                                 tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 2}})
    producer = producer_for(spec, FailingObjective(), tokenizer, per_rank=1, bound=1)
    source = ProcessRollouts().start(setup_for(producer, tokenizer, 3, bound=1),
                                     state_of(tiny_model))
    try:
        with pytest.raises(ZeroDivisionError, match="the grader divided by zero") as err:
            source.get(0)
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert "in the rollout process" in notes and ", in reward" in notes
    finally:
        source.stop()


def test_a_killed_rollout_process_is_named_and_a_stall_times_out(tokenizer, tiny_model,
                                                                 monkeypatch):
    monkeypatch.delenv("CRUCIBLE_THREADS", raising=False)
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 2}})
    objective = build_objective(spec.task)
    producer = producer_for(spec, objective, tokenizer, per_rank=1, bound=0)
    source = ProcessRollouts().start(setup_for(producer, tokenizer, 4, timeout=1.0),
                                     state_of(tiny_model))
    # Learner and child split the learner's cores: half each (at least one thread).
    split = threads.allotment(2 * threads.sharers()).threads
    assert source.child_threads == torch.get_num_threads() == split
    try:
        source.get(0)
        # The learner "forgot" version 1: the child's wait times out, and the learner hears.
        with pytest.raises(AsyncStall, match="weights of version >= 1"):
            source.get(1)
    finally:
        source.stop()
    source = ProcessRollouts().start(setup_for(producer, tokenizer, 4, timeout=30.0),
                                     state_of(tiny_model))
    try:
        source.get(0)
        os.kill(source.proc.pid, signal.SIGKILL)  # killed while waiting for version 1
        source.proc.join(10)
        t0 = time.monotonic()
        source.weights.write(1, state_of(tiny_model))  # nothing the dead child held blocks it
        assert time.monotonic() - t0 < 5
        with pytest.raises(RolloutProcessFailed, match=r"exited with code -9 before handing "
                                                        r"over the rollout batch of step 2"):
            source.get(1)
        with pytest.raises(RolloutProcessFailed, match="before taking weight version 1"):
            source.publish(1, state_of(tiny_model))
    finally:
        source.stop()


ORPHAN = """
import os, sys, torch
torch.set_num_threads(1)
from tests.workers.rl.test_process_actor import MODEL, producer_for, setup_for, state_of
from workers.rl.model import build_policy
from workers.rl.objectives import build_objective
from workers.rl.process_actor import ProcessRollouts
from workers.rl.spec import ArithmeticSpec, parse_spec
from workers.rl.tokenizer import train_bpe
objective = build_objective(ArithmeticSpec())
tok = train_bpe(objective.corpus(), vocab_size=96)
model = build_policy(MODEL, len(tok), tok.pad_token_id, tok.eos_token_id)
spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 2}})
producer = producer_for(spec, objective, tok, per_rank=1, bound=0)
source = ProcessRollouts().start(setup_for(producer, tok, 4, timeout=300.0), state_of(model))
source.get(0)
print(source.proc.pid, flush=True)
os._exit(0)  # the learner dies without stopping its rollout process
"""


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_rollout_process_whose_learner_died_exits_by_itself():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CRUCIBLE_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 30  # it notices within a poll (0.5 s) of its wait
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid), f"the orphaned rollout process {pid} is still running"


def test_a_producer_that_does_not_pickle_is_refused_clearly(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 2}})
    producer = producer_for(spec, build_objective(spec.task), tokenizer, per_rank=1, bound=1)
    producer.generator = lambda *key: torch.Generator()  # a closure: not picklable
    with pytest.raises(ValueError, match="could not be pickled.*async_actor = 'thread'"):
        ProcessRollouts().start(setup_for(producer, tokenizer, 2, bound=1),
                                state_of(tiny_model))
    assert not multiprocessing.active_children()


# ---- the spec and whole runs ----------------------------------------------------------------


def test_the_spec_refuses_a_process_actor_without_async_steps_or_beside_ray_actors():
    with pytest.raises(ValueError, match="needs trainer.max_async_steps >= 1"):
        parse_spec({"trainer": {"async_actor": "process"}})
    with pytest.raises(ValueError, match="drop trainer.async_actor = 'process'"):
        parse_spec({"trainer": {"async_actor": "process", "max_async_steps": 1},
                    "cluster": {"rollout_actors": 1}})
    assert parse_spec({"trainer": {"async_actor": "process", "max_async_steps": 1}}
                      ).trainer.async_actor == "process"


def test_a_run_with_the_rollout_process_trains_within_the_staleness_bound(tmp_path):
    spec = run_spec(tmp_path, "proc", trainer={"max_async_steps": 1, "steps": 5,
                                               "async_actor": "process", "eval_every": 5},
                    algorithm={"importance": "tis"})
    result = train(spec, JsonlSink(tmp_path / "m.jsonl"), objective=ParityObjective())
    assert sorted(result.losses) == [1, 2, 3, 4, 5] and set(result.eval_reward) == {0, 5}
    assert result.steps_per_s > 0 and sorted(result.train_time) == [1, 2, 3, 4, 5]
    steps = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert len(steps) == 5
    for m in steps:
        assert m["async/lag0"] + m["async/lag1"] == 2 * 4  # every sample within the bound
        assert 0.0 <= m["async/learner_idle"] <= 1.0
        assert 0.0 <= m["async/generator_idle"] <= 1.0
    assert not multiprocessing.active_children()  # the child is reaped with the run
