"""Failed trajectories are triaged: a sample the platform failed (sandbox error, lost session,
a tool's infrastructure) is retried, then its group dropped and counted, never trained on with
reward 0; valid failures feed the curriculum's replay buffer. Pure parts against hand-computed
values, the producer with a real tiny policy, and the real sandbox made unavailable."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Sequence

import pytest
import torch

from workers.envs import as_objective, load_environment
from workers.envs.base import (
    INFRA,
    Component,
    Environment,
    EnvTask,
    InfraError,
    Message,
    Reply,
    Rubric,
)
from workers.envs.mixed import MixedObjective
from workers.rl.actor import Producer
from workers.rl.curriculum import ReplayBuffer, TaskSampler
from workers.rl.episodes import play_groups
from workers.rl.objectives import Example
from workers.rl.rollout import HFRollout
from workers.rl.spec import CurriculumSpec, RolloutSpec, parse_spec
from workers.rl.triage import InfraFailure, TriageCounts, grade, take_infra, void_groups


def examples(n: int) -> list[Example]:
    return [Example(prompt=f"p{i}", reference=str(i)) for i in range(n)]


def identity_perm(epoch: int, n: int) -> list[int]:
    return list(range(n))


class Flaky:
    """An objective whose grader the platform fails: on every call for `always` prompts, on
    the first call a prompt appears in for `once` prompts. Otherwise reward 1 for an
    even-length completion. Counts the samples it was asked to grade."""

    def __init__(self, n: int, always: Sequence[str] = (), once: Sequence[str] = ()) -> None:
        self.train, self.eval = examples(n), examples(2)
        self.always, self.once = set(always), set(once)
        self.seen: set[str] = set()
        self.graded: list[str] = []
        self.reward = self.score

    def score(self, exs: Sequence[Example], completions: Sequence[str]
              ) -> tuple[list[float], dict[str, list[float]]]:
        r, infra = [], []
        for e, c in zip(exs, completions, strict=True):
            bad = e.prompt in self.always or (e.prompt in self.once and e.prompt not in self.seen)
            infra.append(1.0 if bad else 0.0)
            r.append(0.0 if bad else float(len(c) % 2 == 0))
            self.graded.append(e.prompt)
        self.seen |= {e.prompt for e in exs}
        return r, {"parity": list(r), INFRA: infra}

    def corpus(self) -> list[str]:
        return ["p0 p1 p2 p3 0123456789"]


# ---- pure parts --------------------------------------------------------------------------


def test_grade_retries_failed_samples_then_flags_what_still_fails():
    obj = Flaky(4, always=["p3"], once=["p1"])
    counts = TriageCounts()
    g = grade(obj.reward, obj.train, ["aa", "b", "cc", "dd"], 2, counts)
    # p1 recovered on the first retry (odd length: 0.0), p3 failed all three times
    assert g.rewards == [1.0, 0.0, 1.0, 0.0]
    assert g.infra == [False, False, False, True]
    assert INFRA not in g.components and g.components["parity"] == [1.0, 0.0, 1.0, 0.0]
    # first call: p1 and p3 fail (2); retry 1 re-grades both (2), retry 2 only p3 (1)
    assert (counts.failed, counts.retried, counts.recovered) == (2, 3, 1)
    assert obj.graded == ["p0", "p1", "p2", "p3", "p1", "p3", "p3"]
    none = TriageCounts()
    assert grade(obj.reward, obj.train[:1], ["x"], 0, none).infra == [False]
    assert none == TriageCounts()


def test_infra_column_and_void_groups():
    comps = {"a": [1.0, 0.0, 1.0], INFRA: [0.0, 1.0, 0.0]}
    assert take_infra(comps, 3) == [False, True, False] and INFRA not in comps
    assert take_infra({"a": [1.0]}, 1) == [False]
    with pytest.raises(ValueError, match="2 values for 3 samples"):
        take_infra({INFRA: [0.0, 1.0]}, 3)
    assert void_groups([False, False, True, False, False, False], 2) == [False, True, False]
    totals = TriageCounts(failed=3, retried=4, recovered=1, dropped_groups=2)
    counts = {"infra/failed": 1.0}
    totals.add_to(counts)
    assert counts == {"infra/failed": 4.0, "infra/retried": 4.0, "infra/recovered": 1.0,
                      "infra/dropped_groups": 2.0}


def flagging_env() -> Environment:
    """A rubric whose checker could not run for the answer 'broken' (its info says infra)."""
    def check(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        return [(0.0, {"infra": "engine down"}) if c == "broken" else (1.0, {})
                for c in completions]

    return Environment(tasks=[EnvTask(id="t", prompt="q", answer="a")],
                       rubric=Rubric((Component("c", 1.0, check, "custom"),)))


def test_scores_carry_infra_to_the_objective_column_unprefixed_in_a_mix():
    env = flagging_env()
    scores = env.score([env.tasks[0]] * 2, ["fine", "broken"])
    assert [s.infra for s in scores] == [None, "c: engine down"]
    obj = as_objective(env)
    rewards, comps = obj.reward([obj.train[0]] * 2, ["fine", "broken"])
    assert rewards == [1.0, 0.0] and comps[INFRA] == [0.0, 1.0]
    _, clean = obj.reward([obj.train[0]], ["fine"])
    assert INFRA not in clean  # objectives that do not fail say nothing
    mixed = MixedObjective([obj, as_objective(flagging_env())], ["a", "b"])
    _, comps = mixed.reward(mixed.train, ["broken", "fine"])
    assert comps[INFRA] == [1.0, 0.0] and "a/c" in comps and "a/" + INFRA not in comps


def test_replay_buffer_keeps_the_newest_valid_failures_and_the_sampler_replays_them():
    spec = CurriculumSpec(replay_share=1.0, replay_capacity=2, explore=0.0)
    ex = examples(6)
    s = TaskSampler(ex, spec, seed=0, rank=0, world=1, permutation=identity_perm)
    s.record(ex[0], [0.0, 1.0], ["a", "bb"], step=1)  # one failure: p0 in
    s.record(ex[1], [1.0, 1.0], ["x", "y"], step=1)  # no failure: not in
    s.record(ex[2], [0.0, 0.0], ["c", "d"], step=2)
    s.record(ex[3], [0.2, 0.9], ["e", "f"], step=3)  # full: p0, the oldest, goes
    assert [t["example"]["prompt"] for t in s.replay.trajectories()] == ["p2", "p3"]
    assert s.replay.evicted == 1
    assert s.replay.trajectories()[1] == {
        "example": {"prompt": "p3", "reference": "3", "meta": {}},
        "failed": [{"text": "e", "reward": 0.2}], "step": 3}
    s.record(ex[2], [1.0, 1.0], ["g", "h"], step=4)  # p2 solved now: out
    s.record(ex[4], [0.0, 0.4], ["i", "j"], step=4)
    assert [t["example"]["prompt"] for t in s.replay.trajectories()] == ["p3", "p4"]
    state = json.loads(json.dumps(s.state_dict()))
    # share 1: every slot replays while the buffer lasts (oldest first), then the stream
    assert [e.prompt for e in s.take(3)] == ["p3", "p4", "p0"]
    assert s.replayed == 2 and s.cursor == 1 and len(s.replay) == 0
    t = TaskSampler(ex, spec, seed=0, rank=0, world=1, permutation=identity_perm)
    t.load_state_dict(state)  # a resumed run replays the same tasks
    assert [e.prompt for e in t.take(3)] == ["p3", "p4", "p0"]
    old = {k: v for k, v in state.items() if k not in ("replay", "slots", "replayed")}
    u = TaskSampler(ex, spec, seed=0, rank=0, world=1, permutation=identity_perm)
    u.load_state_dict(old)  # a checkpoint from before the buffer
    assert len(u.replay) == 0 and u.slots == 0
    off = TaskSampler(ex, CurriculumSpec(explore=0.0), 0, 0, 1, identity_perm)
    off.record(ex[5], [0.0], ["k"], step=1)
    assert len(off.replay) == 0 and [e.prompt for e in off.take(2)] == ["p0", "p1"]


def test_replay_buffer_capacity_one():
    buf = ReplayBuffer(1)
    buf.observe(Example("a", "1"), ["x"], [0.0], 0.5, 1)
    buf.observe(Example("b", "2"), ["y"], [0.0], 0.5, 2)
    assert len(buf) == 1 and buf.pop_oldest() == Example("b", "2") and buf.evicted == 1


# ---- the producer: void groups are dropped, replaced and counted ---------------------------


def make_producer(spec, objective, tokenizer, per_rank=2):
    sampler = TaskSampler(objective.train, spec.curriculum, 0, 0, 1, identity_perm)

    def gen(*key):
        return torch.Generator().manual_seed(hash(key) & 0xFFFF_FFFF)

    return Producer(spec, objective, sampler, tokenizer.pad_token_id, per_rank, 0, gen, 0)


def test_producer_drops_void_groups_and_replaces_them(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 4},
                       "triage": {"retries": 1},
                       # a share so small no slot replays: the buffer fills, draws stay the stream
                       "curriculum": {"replay_share": 1e-9, "explore": 0.0}})
    obj = Flaky(6, always=["p0"], once=["p1"])
    producer = make_producer(spec, obj, tokenizer)
    sb = producer.produce(0, lambda: (0, HFRollout(tiny_model, tokenizer)))
    # round 1 draws p0, p1: all four samples fail; the retry recovers p1's two and p0's group
    # is dropped; round 2 draws one more prompt, p2
    assert sb.prompts == ["p1", "p1", "p2", "p2"]
    assert sb.counts["infra/failed"] == 4 and sb.counts["infra/retried"] == 4
    assert sb.counts["infra/recovered"] == 2 and sb.counts["infra/dropped_groups"] == 1
    assert sb.counts["filter/rounds"] == 2
    assert sb.rewards.tolist() == [float(len(t) % 2 == 0) for t in sb.batch.texts]
    assert INFRA not in sb.components and sb.components["parity"] == sb.rewards.tolist()
    # p0 never reached the curriculum: no pass rate, no replay entry
    assert set(producer.sampler.buffer.entries) == {"p1", "p2"}
    replayed = {t["example"]["prompt"] for t in producer.sampler.replay.trajectories()}
    assert "p0" not in replayed
    assert replayed == {p for p, r in zip(sb.prompts, sb.rewards.tolist(), strict=True)
                        if r < 0.5}


def test_a_persistently_failing_platform_stops_the_step(tokenizer, tiny_model):
    spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 3},
                       "triage": {"retries": 1}, "curriculum": {"max_rounds": 2}})
    obj = Flaky(4, always=["p0", "p1", "p2", "p3"])
    producer = make_producer(spec, obj, tokenizer)
    with pytest.raises(InfraFailure, match="0 of 2 groups could be scored after 2 rounds"):
        producer.produce(0, lambda: (0, HFRollout(tiny_model, tokenizer)))
    assert producer.sampler.buffer.entries == {}


# ---- episodes: a tool or respond raising InfraError voids the episode ----------------------


class BrokenTurns(Environment):
    """Multi-turn: respond fails for the platform's sake `broken` times, then replies."""

    def __init__(self, broken: int) -> None:
        self.broken = broken
        self.graded = 0

        def check(tasks, completions):
            self.graded += len(completions)
            return [(1.0, {}) for _ in completions]

        super().__init__(tasks=[EnvTask(id="t", prompt="12", answer="3")],
                         rubric=Rubric((Component("c", 1.0, check, "custom"),)),
                         mode="multi_turn", max_turns=2)

    def respond(self, task: EnvTask, conversation: Sequence[Message]) -> Reply:
        if self.broken > 0:
            self.broken -= 1
            raise InfraError("session lost")
        return Reply([{"role": "user", "content": "again"}], done=False)


@pytest.mark.parametrize(("broken", "retries", "expect"), [
    # episode 0 void, episode 1 fine; the re-play of episode 0 is fine
    (1, 1, {"infra": [False, False], "rewards": [1.0, 1.0], "counts": (1, 1, 1), "graded": 2}),
    # both void, both re-played void again: flagged, never graded
    (4, 1, {"infra": [True, True], "rewards": [0.0, 0.0], "counts": (2, 2, 0), "graded": 0}),
    (1, 0, {"infra": [True, False], "rewards": [0.0, 1.0], "counts": (1, 0, 0), "graded": 1}),
])
def test_void_episodes_are_replayed_then_flagged(tokenizer, tiny_model, broken, retries,
                                                 expect):
    env = BrokenTurns(broken)
    obj = as_objective(env)
    counts = TriageCounts()
    g = torch.Generator()
    g.manual_seed(0)
    played = play_groups(obj, obj.train, [obj.episode_env(obj.train[0])], 2,
                         HFRollout(tiny_model, tokenizer), tokenizer,
                         RolloutSpec(group_size=2, max_new_tokens=3), g, tokenizer.pad_token_id,
                         4096, retries, counts)
    assert played.infra == expect["infra"] and played.rewards == expect["rewards"]
    assert (counts.failed, counts.retried, counts.recovered) == expect["counts"]
    assert env.graded == expect["graded"]


def test_run_episodes_leaves_a_void_episode_ungraded(tokenizer):
    from workers.envs.rollout import run_episodes
    from workers.rl.episodes import PlainCodec

    env = BrokenTurns(1)
    eos = tokenizer.eos_token_id

    def stop_at_once(token_ids):
        return [eos], [-0.5]

    first, second = run_episodes(env, [env.tasks[0]] * 2, stop_at_once, PlainCodec(tokenizer))
    assert first.stop_reason == "infra" and first.infra == "session lost" and first.turns == 1
    assert first.score is not None and first.score.infra == "session lost"
    assert first.score.total == 0.0 and first.score.components == {}
    assert second.stop_reason == "max_turns" and second.score is not None
    assert second.score.infra is None and second.score.total == 1.0
    assert env.graded == 1  # only the valid episode reached the grader


# ---- the real sandbox, made unavailable ------------------------------------------------------


def _sandbox():
    from tests.workers.envs.conftest import sandbox_unavailable, shared_sandbox

    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    return shared_sandbox()


@contextlib.contextmanager
def python_toolchain_gone() -> Iterator[None]:
    """The sandbox's Python interpreter vanishes from the host (a broken image, an unmounted
    toolchain): every Python execution is the engine's SANDBOX_ERROR."""
    from workers.sandbox import languages

    saved = languages.LANGUAGE_TABLE["python"]
    languages.LANGUAGE_TABLE["python"] = dataclasses.replace(
        saved, requires=("/nonexistent/crucible-python3",))
    try:
        yield
    finally:
        languages.LANGUAGE_TABLE["python"] = saved


class HealingSandbox:
    """The shared engine, with the toolchain gone for its first batch only (restored after)."""

    def __init__(self, inner) -> None:
        self.inner, self.concurrency, self.batches = inner, inner.concurrency, 0

    @property
    def engine(self):
        return self.inner.engine

    def run(self, requests):
        self.batches += 1
        if self.batches == 1:
            with python_toolchain_gone():
                return self.inner.run(requests)
        return self.inner.run(requests)


def test_a_sandbox_failure_is_not_scored_zero_and_a_retry_recovers_the_true_reward():
    sandbox = HealingSandbox(_sandbox())
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=sandbox)
    obj = as_objective(env)
    exs = obj.train[:3]
    references = [env.task(e.meta["task_id"]).reference for e in exs]
    counts = TriageCounts()
    g = grade(obj.reward, exs, references, 1, counts)
    # The first batch met a sandbox without Python: the reference solutions would have been
    # scored 0 and trained on as failures. Flagged instead, re-graded, they pass.
    assert g.rewards == [1.0, 1.0, 1.0] and g.infra == [False, False, False]
    assert (counts.failed, counts.retried, counts.recovered) == (3, 3, 3)
    assert g.components["verdict_passed"] == [1.0, 1.0, 1.0]
    assert g.components["verdict_sandbox_error"] == [0.0, 0.0, 0.0]


def test_an_unavailable_sandbox_drops_groups_instead_of_training_on_zero(tokenizer, tiny_model):
    sandbox = _sandbox()
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=sandbox)
    obj = as_objective(env)
    with python_toolchain_gone():
        rewards, comps = obj.reward(obj.train[:2], ["def f():\n    return 1\n"] * 2)
        assert rewards == [0.0, 0.0] and comps[INFRA] == [1.0, 1.0]
        assert comps["verdict_sandbox_error"] == [1.0, 1.0]
        spec = parse_spec({"rollout": {"group_size": 2, "max_new_tokens": 3},
                           "triage": {"retries": 1}, "curriculum": {"max_rounds": 2}})
        producer = make_producer(spec, obj, tokenizer)
        with pytest.raises(InfraFailure, match="voided by infrastructure failures"):
            producer.produce(0, lambda: (0, HFRollout(tiny_model, tokenizer)))
    assert producer.sampler.buffer.entries == {}  # no 0 reached the curriculum either


def test_a_sandbox_failure_mid_episode_voids_the_episode(tokenizer, tiny_model):
    sandbox = _sandbox()
    env = load_environment({"source": "builtin", "name": "code_repair",
                            "params": {"max_turns": 2}}, sandbox=sandbox)
    obj = as_objective(env)
    counts = TriageCounts()
    g = torch.Generator()
    g.manual_seed(0)
    with python_toolchain_gone():  # the feedback turn's test run meets no Python
        played = play_groups(obj, obj.train[:1], [obj.episode_env(obj.train[0])], 2,
                             HFRollout(tiny_model, tokenizer),
                             tokenizer, RolloutSpec(group_size=2, max_new_tokens=3), g,
                             tokenizer.pad_token_id, 4096, 1, counts)
    assert played.infra == [True, True] and played.rewards == [0.0, 0.0]
    assert (counts.failed, counts.retried, counts.recovered) == (2, 2, 0)
    assert played.counts["episode/turns"] == 2  # each ended at its first feedback turn


def test_the_python_tool_on_a_broken_sandbox_raises_instead_of_answering():
    sandbox = _sandbox()
    env = load_environment({"source": "tasks",
                            "tasks": [{"id": "t", "prompt": "6*7?", "answer": "42"}],
                            "rubric": {"components": [{"name": "c", "checker": "math_equiv"}]},
                            "interaction": {"mode": "tool_use", "max_turns": 2,
                                            "tools": ["python", "calculator"]}},
                           sandbox=sandbox)
    assert "status: OK" in env.call_tool("python", {"code": "print(6*7)"})["content"]
    with python_toolchain_gone(), pytest.raises(InfraError, match="python tool's sandbox"):
        env.call_tool("python", {"code": "print(6*7)"})
    # the model's own mistakes stay feedback
    assert env.call_tool("calculator", {"expression": "6/0"})["content"].startswith("error:")


HOSTILE_INFRA = [
    # prints what an engine failure looks like, then exits early
    'import sys\nprint("SANDBOX_ERROR: sandbox failure: engine down")\nsys.exit(0)\n',
    # dies by a signal the way a killed sandbox would
    'import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n',
    # writes a fake status/verdict file and closes its output streams
    'import os\nopen("status.json", "w").write(\'{"status": "SANDBOX_ERROR"}\')\n'
    'os.close(1)\nos.close(2)\n',
]


@pytest.mark.parametrize("program", HOSTILE_INFRA, ids=["prints", "sigkill", "fake-status"])
def test_a_program_cannot_pass_itself_off_as_an_infrastructure_failure(program):
    """The infra flag comes from the engine's own status, never from what the program prints,
    writes or how it dies: a hostile completion that imitates a sandbox failure is scored 0
    as the policy's own failure (trained on), not dropped as void."""
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=_sandbox())
    obj = as_objective(env)
    exs = obj.train[:1]
    reference = env.task(exs[0].meta["task_id"]).reference
    counts = TriageCounts()
    g = grade(obj.reward, exs * 2, [f"```python\n{program}```", reference], 2, counts)
    assert g.rewards == [0.0, 1.0] and g.infra == [False, False]  # the same path scores 1
    assert (counts.failed, counts.retried) == (0, 0)
