"""Online difficulty filtering and curriculum: which prompts a step trains on.

A group whose completions all got the same reward has zero group-relative advantage: it costs
a rollout and an update and teaches nothing. Such groups are skipped (counted) and replaced by
sampling more prompts. Every scored group also updates a per-task pass-rate buffer, and the
sampler skips tasks whose known pass rate lies outside a configured band (with a small
exploration probability, so a task judged too easy or too hard is re-measured now and then).

Failed trajectories are screened and replayed: a group whose completions are valid (scored by
the policy's own doing, not voided by an infrastructure failure: workers/rl/triage.py) but
failed (reward below `pass_threshold`) puts its task and those completions in a bounded replay
buffer; with `replay_share` > 0 each slot of a draw takes the oldest buffered task with that
probability, ahead of the data stream and regardless of the band. A task whose later group has no
failure leaves the buffer; a full buffer drops its oldest task.

The sampler state (its position in the data stream, the buffers, its counters) is plain JSON and
is saved with every checkpoint, so a resumed run continues with exactly the same curriculum.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from workers.rl.objectives import Example
from workers.rl.spec import CurriculumSpec


def is_uniform(rewards: Sequence[float]) -> bool:
    """True when a group teaches nothing: every completion got the same reward."""
    return max(rewards) == min(rewards)


def group_pass_rate(rewards: Sequence[float], threshold: float) -> float:
    return sum(1.0 for r in rewards if r >= threshold) / len(rewards)


class PassRates:
    """Per-task pass rates: an exponential moving average of each group's pass rate, keyed by
    prompt, with the number of groups seen. The first observation sets the rate outright."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.entries: dict[str, tuple[int, float]] = {}  # prompt -> (groups seen, rate)

    def update(self, key: str, rate: float) -> None:
        seen, old = self.entries.get(key, (0, rate))
        self.entries[key] = (seen + 1, old + self.alpha * (rate - old) if seen else rate)

    def rate(self, key: str, min_seen: int = 1) -> float | None:
        seen, value = self.entries.get(key, (0, 0.0))
        return value if seen >= min_seen else None

    def state_dict(self) -> dict[str, list[float]]:
        return {k: [seen, rate] for k, (seen, rate) in sorted(self.entries.items())}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.entries = {k: (int(seen), float(rate)) for k, (seen, rate) in state.items()}


class ReplayBuffer:
    """Tasks whose latest valid group had failed completions, oldest first, at most `capacity`:
    per task its Example and the failed completions (text, reward) with the step they came
    from. Keyed by prompt, like the pass-rate buffer."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: dict[str, dict[str, Any]] = {}  # prompt -> entry, insertion = age
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def observe(self, example: Example, texts: Sequence[str], rewards: Sequence[float],
                threshold: float, step: int) -> None:
        """A valid group's outcome: its failures (re)enter the buffer as its newest task; a
        group with none takes the task out (it is solved for now)."""
        failed = [(t, float(r)) for t, r in zip(texts, rewards, strict=True) if r < threshold]
        self.entries.pop(example.prompt, None)
        if not failed:
            return
        self.entries[example.prompt] = {
            "example": {"prompt": example.prompt, "reference": example.reference,
                        "meta": dict(example.meta)},
            "failed": [{"text": t, "reward": r} for t, r in failed], "step": step}
        while len(self.entries) > self.capacity:
            self.entries.pop(next(iter(self.entries)))
            self.evicted += 1

    def pop_oldest(self) -> Example:
        entry = self.entries.pop(next(iter(self.entries)))["example"]
        return Example(prompt=entry["prompt"], reference=entry["reference"],
                       meta=dict(entry["meta"]))

    def trajectories(self) -> list[dict[str, Any]]:
        """The buffered failures, oldest task first (for inspection and tests)."""
        return [dict(e) for e in self.entries.values()]

    def state_dict(self) -> dict[str, Any]:
        return {"entries": list(self.entries.values()), "evicted": self.evicted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = {e["example"]["prompt"]: e for e in state.get("entries", [])}
        self.evicted = int(state.get("evicted", 0))


def in_band(rate: float | None, low: float, high: float) -> bool:
    """Unmeasured tasks are always in the band: they have to be tried to be measured."""
    return rate is None or low <= rate <= high


class TaskSampler:
    """This rank's stream of training examples over seeded per-epoch shuffles of the objective's
    training split.

    Rank r of W reads stream positions r, r+W, r+2W, ...; with a world of one and no band this
    is exactly the shuffled order. `cursor` counts positions this rank has consumed (taken or
    skipped); everything random is derived from (seed, position), so state = JSON.
    """

    def __init__(
        self,
        train: Sequence[Example],
        spec: CurriculumSpec,
        seed: int,
        rank: int,
        world: int,
        permutation: Callable[[int, int], list[int]],
    ):
        if not train:
            raise ValueError("the objective has no training examples")
        self.train, self.spec, self.seed = train, spec, seed
        self.rank, self.world = rank, world
        self.permutation = permutation  # (epoch, n) -> order
        self.cursor = 0
        self.band_skipped = 0
        self.buffer = PassRates(spec.ema)
        self.replay = ReplayBuffer(spec.replay_capacity)
        self.slots = 0  # draw slots so far: each one's replay coin is seeded by its index
        self.replayed = 0
        self._order: tuple[int, list[int]] = (-1, [])

    def _example(self, pos: int) -> Example:
        epoch, i = divmod(pos * self.world + self.rank, len(self.train))
        if self._order[0] != epoch:
            self._order = (epoch, self.permutation(epoch, len(self.train)))
        return self.train[self._order[1][i]]

    def _explore(self, pos: int) -> bool:
        if self.spec.explore <= 0.0:
            return False
        return random.Random(f"{self.seed}:{self.rank}:{pos}").random() < self.spec.explore

    def _replay(self) -> bool:
        """Whether this slot replays a buffered failed task (seeded by the slot's index)."""
        slot = self.slots
        self.slots += 1
        if self.spec.replay_share <= 0.0 or not self.replay:
            return False
        coin = random.Random(f"{self.seed}:{self.rank}:replay:{slot}").random()
        return coin < self.spec.replay_share

    def take(self, n: int) -> list[Example]:
        """n examples: per slot the oldest buffered failed task with probability
        `replay_share`, else the next stream example whose pass rate is in the band. After a
        full pass over the data with nothing in the band, the band is ignored rather than
        looping forever."""
        spec, misses = self.spec, 0
        out: list[Example] = []
        while len(out) < n:
            if misses == 0 and self._replay():
                out.append(self.replay.pop_oldest())
                self.replayed += 1
                continue
            pos = self.cursor
            self.cursor += 1
            ex = self._example(pos)
            rate = self.buffer.rate(ex.prompt, spec.min_seen)
            if (in_band(rate, spec.band_low, spec.band_high) or self._explore(pos)
                    or misses >= len(self.train)):
                out.append(ex)
                misses = 0
            else:
                self.band_skipped += 1
                misses += 1
        return out

    def record(self, example: Example, rewards: Sequence[float],
               texts: Sequence[str] | None = None, step: int = 0) -> None:
        """A valid group's rewards (never one voided by an infrastructure failure); with its
        completions, its failures feed the replay buffer when replay is on."""
        self.buffer.update(example.prompt, group_pass_rate(rewards, self.spec.pass_threshold))
        if texts is not None and self.spec.replay_share > 0.0:
            self.replay.observe(example, texts, rewards, self.spec.pass_threshold, step)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "band_skipped": self.band_skipped,
                "buffer": self.buffer.state_dict(), "replay": self.replay.state_dict(),
                "slots": self.slots, "replayed": self.replayed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.band_skipped = int(state["band_skipped"])
        self.buffer.load_state_dict(state["buffer"])
        # checkpoints from before the replay buffer have none of these
        self.replay.load_state_dict(state.get("replay", {}))
        self.slots = int(state.get("slots", 0))
        self.replayed = int(state.get("replayed", 0))
