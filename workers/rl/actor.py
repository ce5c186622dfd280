"""The actor side of the loop: producing one step's scored, filtered groups, inline or async.

`Producer.produce(step)` samples prompts from the curriculum, generates `group_size`
completions per prompt with the current weights, scores them, drops groups that teach nothing
and samples more (up to `max_rounds`), and returns a `StepBatch` whose every group carries the
weight version that generated it.

With `max_async_steps = k > 0` an `AsyncActor` thread runs the producer on its own copy of the
policy while the learner trains: batch n is generated with weights of version >= n - k (the
learner publishes version v after its v-th update), so generation of step n+k overlaps training
of step n. Surplus groups of a round are kept for later steps while they are fresh; groups older
than the bound are dropped and counted. Hand-offs in both directions (weights to the actor,
batches to the learner) time out with `AsyncStall` instead of hanging.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from workers.rl import balance
from workers.rl.curriculum import TaskSampler, is_uniform
from workers.rl.episodes import (
    EPISODE_COUNTS,
    EpisodeBatch,
    episodic,
    loss_mask,
    play_groups,
    plays_episodes,
)
from workers.rl.lora import load_weights
from workers.rl.model import build_policy
from workers.rl.objectives import Example, Objective
from workers.rl.rollout import RolloutBackend, RolloutBatch
from workers.rl.route_taps import replayable_routers
from workers.rl.routing import pad_routes
from workers.rl.spec import ModelSpec, RunSpec
from workers.rl.triage import InfraFailure, TriageCounts, grade, void_groups


class AsyncStall(RuntimeError):
    """A weight or batch hand-off between learner and actor did not happen in time."""


@dataclass
class Group:
    """One prompt's `group_size` completions, scored, and the weight version that sampled them."""

    example: Example
    batch: RolloutBatch
    rewards: list[float]
    components: dict[str, list[float]]
    version: int


@dataclass
class StepBatch:
    step: int
    batch: RolloutBatch
    rewards: torch.Tensor  # (groups * G,)
    components: dict[str, list[float]]
    versions: list[int]  # per group
    sampler_state: dict[str, Any]  # curriculum state right after this batch was drawn
    counts: dict[str, float] = field(default_factory=dict)  # summed over ranks
    gen_s: float = 0.0  # time spent generating and scoring
    gen_idle_s: float = 0.0  # time the actor waited (weights, queue) for this batch
    prompts: list[str] = field(default_factory=list)  # per sequence (groups * G)
    advantages: torch.Tensor | None = None  # (groups * G,), set by the learner


def pad_cat(parts: list[torch.Tensor], pad: float, left: bool) -> torch.Tensor:
    """Concatenate (b_i, w_i) tensors along dim 0, padding each to the widest on the left or
    right."""
    width = max(p.shape[1] for p in parts)
    out = []
    for p in parts:
        if p.shape[1] == width:  # groups of one generate call are equally wide
            out.append(p)
            continue
        fill = torch.full((p.shape[0], width - p.shape[1]), pad, dtype=p.dtype)
        out.append(torch.cat([fill, p] if left else [p, fill], 1))
    return torch.cat(out, 0)


def merge(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from several, keeping the layout: prompts left-padded, completions right.
    Episode groups among them make an EpisodeBatch (single-turn rows: loss mask = attention)."""
    if len(batches) == 1:
        return batches[0]
    fields: dict[str, Any] = dict(
        prompt_ids=pad_cat([b.prompt_ids for b in batches], pad_id, left=True),
        prompt_mask=pad_cat([b.prompt_mask for b in batches], 0, left=True),
        completion_ids=pad_cat([b.completion_ids for b in batches], pad_id, left=False),
        completion_mask=pad_cat([b.completion_mask for b in batches], 0, left=False),
        logprobs=pad_cat([b.logprobs for b in batches], 0.0, left=False),
        texts=[t for b in batches for t in b.texts],
        prompt_routes=pad_routes([b.prompt_routes for b in batches], left=True),
        completion_routes=pad_routes([b.completion_routes for b in batches], left=False),
    )
    episodes = [b for b in batches if isinstance(b, EpisodeBatch)]
    if not episodes:
        return RolloutBatch(**fields)
    return EpisodeBatch(**fields, loss_mask=pad_cat([loss_mask(b) for b in batches], 0,
                                                    left=False),
                        norm_len=max(b.norm_len for b in episodes))


def split_groups(batch: RolloutBatch, group: int) -> list[RolloutBatch]:
    """Per-prompt views of a batch of consecutive groups."""
    out: list[RolloutBatch] = []
    for i in range(0, batch.completion_ids.shape[0], group):
        sl = slice(i, i + group)
        parts = (batch.prompt_ids[sl], batch.prompt_mask[sl], batch.completion_ids[sl],
                 batch.completion_mask[sl], batch.logprobs[sl], batch.texts[sl])
        pr, cr = batch.prompt_routes, batch.completion_routes
        p_routes, c_routes = (None if r is None else r[sl] for r in (pr, cr))
        if isinstance(batch, EpisodeBatch):
            out.append(EpisodeBatch(*parts, loss_mask=batch.loss_mask[sl],
                                    norm_len=batch.norm_len, prompt_routes=p_routes,
                                    completion_routes=c_routes))
        else:
            out.append(RolloutBatch(*parts, prompt_routes=p_routes,
                                    completion_routes=c_routes))
    return out


def take_fresh(pool: list[Group], step: int, bound: int) -> tuple[list[Group], int]:
    """Groups usable at `step` (lag = step - version <= bound), and how many were too old."""
    fresh = [g for g in pool if step - g.version <= bound]
    return fresh, len(pool) - len(fresh)


def lag_histogram(versions: list[int], step: int, bound: int, group: int) -> dict[str, float]:
    """Samples per lag 0..bound: the staleness of what a step trains on. A lag outside the
    bound is a broken invariant of the producer, not a metric."""
    hist = {f"async/lag{i}": 0.0 for i in range(bound + 1)}
    for v in versions:
        if not 0 <= step - v <= bound:
            raise AssertionError(f"step {step + 1} got a sample of version {v}: lag outside "
                                 f"0..{bound}")
        hist[f"async/lag{step - v}"] += group
    return hist


@dataclass(frozen=True)
class Seeds:
    """The run's seeded draws, as plain data: a producer holding them can be pickled to
    another process (a rollout actor) and draws there exactly what it would draw here."""

    seed: int

    def generator(self, *key: int) -> torch.Generator:
        """A generator seeded by (seed, *key): the same draw on a resumed run as on the
        uninterrupted one, and in any process (a tuple of ints hashes the same everywhere)."""
        g = torch.Generator()
        g.manual_seed(hash((self.seed, *key)) & 0x7FFF_FFFF_FFFF)
        return g

    def permutation(self, epoch: int, n: int) -> list[int]:
        """The seeded shuffle of the training set for one epoch (same on every rank)."""
        return torch.randperm(n, generator=self.generator(10_000 + epoch)).tolist()


class Producer:
    """Builds StepBatches. `weights()` returns (version, backend) to generate with now;
    `agree(flag)` makes ranks agree on another round (collective under ZeRO-3 lockstep).
    An objective whose examples play as episodes (multi-turn, tool use) needs `tokenizer`: the
    producer's own copy (tokenizers are not shared across threads)."""

    def __init__(self, spec: RunSpec, objective: Objective, sampler: TaskSampler, pad_id: int,
                 per_rank: int, rank: int, generator: Callable[..., torch.Generator],
                 bound: int, tokenizer: Any = None):
        self.spec, self.objective, self.sampler = spec, objective, sampler
        self.pad_id, self.per_rank, self.rank = pad_id, per_rank, rank
        self.generator, self.bound = generator, bound
        self.pool: list[Group] = []  # informative surplus kept for later steps (async only)
        self.episodes = plays_episodes(objective)
        if self.episodes and tokenizer is None:
            raise ValueError("a multi-turn or tool-use objective needs the producer's tokenizer")
        self.tokenizer = tokenizer

    def generate_round(
        self, examples: list[Example], backend: RolloutBackend, generator: torch.Generator,
        counts: dict[str, float], triage: TriageCounts | None = None,
    ) -> tuple[list[RolloutBatch], list[float], dict[str, list[float]], list[bool]]:
        """Per example, its group's batch; the rewards and components of all groups in order,
        and per sample whether the platform failed it even after `triage.retries` (its 0 is
        void: the producer drops its group). Single-turn examples go through one
        `backend.generate` call; episode examples are played turn by turn."""
        group, spec = self.spec.rollout.group_size, self.spec.rollout
        retries = self.spec.triage.retries
        triage = triage if triage is not None else TriageCounts()
        sources = episodic(self.objective, examples) if self.episodes else [None] * len(examples)
        single = [j for j, s in enumerate(sources) if s is None]
        multi = [j for j, s in enumerate(sources) if s is not None]
        parts: list[RolloutBatch | None] = [None] * len(examples)
        rewards: list[float] = [0.0] * (len(examples) * group)
        infra: list[bool] = [False] * len(rewards)
        components: dict[str, list[float]] = {}

        def place(rows: list[int], got: list[float], comps: dict[str, list[float]],
                  void: list[bool]) -> None:
            for k, j in enumerate(rows):
                rewards[j * group:(j + 1) * group] = got[k * group:(k + 1) * group]
                infra[j * group:(j + 1) * group] = void[k * group:(k + 1) * group]
                for name, values in comps.items():
                    column = components.setdefault(name, [0.0] * len(rewards))
                    column[j * group:(j + 1) * group] = values[k * group:(k + 1) * group]

        if single:
            reps = [examples[j] for j in single for _ in range(group)]
            batch = backend.generate([e.prompt for e in reps], spec, generator)
            graded = grade(self.objective.reward, reps, batch.texts, retries, triage)
            for j, part in zip(single, split_groups(batch, group), strict=True):
                parts[j] = part
            place(single, graded.rewards, graded.components, graded.infra)
        if multi:
            played = play_groups(
                self.objective, [examples[j] for j in multi], [sources[j] for j in multi], group,
                backend, self.tokenizer, spec, generator, self.pad_id,
                getattr(self.objective, "episode_max_tokens", 4096), retries, triage)
            for j, part in zip(multi, split_groups(played.batch, group), strict=True):
                parts[j] = part
            place(multi, played.rewards, played.components, played.infra)
            for k, v in played.counts.items():
                counts[k] = counts.get(k, 0.0) + v
        return [p for p in parts if p is not None], rewards, components, infra

    def produce(
        self,
        step: int,
        weights: Callable[[], tuple[int, RolloutBackend]],
        agree: Callable[[bool], bool] | None = None,
    ) -> StepBatch:
        cur, group = self.spec.curriculum, self.spec.rollout.group_size
        # DAPO's dynamic sampling refills as the curriculum's uniform-group filter does.
        refill = cur.filter_uniform or self.spec.algorithm.dynamic_sampling
        kept, stale = take_fresh(self.pool, step, self.bound)
        self.pool = []
        uniform: list[Group] = []
        rounds, gen_s = 0, 0.0
        played: dict[str, float] = dict.fromkeys(EPISODE_COUNTS, 0.0) if self.episodes else {}
        triage = TriageCounts()
        while True:
            want = self.per_rank - len(kept)
            # Groups voided by infrastructure failures are replaced like filtered ones.
            more = want > 0 and (rounds == 0 or ((refill or triage.dropped_groups > 0)
                                                 and rounds < cur.max_rounds))
            if agree is not None:
                more = agree(more)
            if not more:
                break
            # Async rounds draw full batches (the surplus feeds later steps); sync rounds
            # draw what is missing (at least one prompt: lockstep ranks generate together).
            n = self.per_rank if self.bound else max(want, 1)
            examples = self.sampler.take(n)
            version, backend = weights()
            t0 = time.perf_counter()
            key = (step, self.rank) if rounds == 0 else (step, self.rank, rounds)
            groups, rewards, components, infra = self.generate_round(
                examples, backend, self.generator(*key), played, triage)
            gen_s += time.perf_counter() - t0
            rounds += 1
            void = void_groups(infra, group)
            for j, (ex, part) in enumerate(zip(examples, groups, strict=True)):
                if void[j]:  # never trained on, never counted in the curriculum
                    triage.dropped_groups += 1
                    continue
                sl = slice(j * group, (j + 1) * group)
                g = Group(ex, part, list(rewards[sl]),
                          {k: list(v[sl]) for k, v in components.items()}, version)
                self.sampler.record(ex, g.rewards, part.texts, step)
                if refill and is_uniform(g.rewards):
                    uniform.append(g)
                else:
                    kept.append(g)
        fallback = max(0, self.per_rank - len(kept))
        if fallback > len(uniform) and triage.dropped_groups:
            raise InfraFailure(
                f"step {step + 1}: only {len(kept) + len(uniform)} of {self.per_rank} groups "
                f"could be scored after {rounds} rounds: {triage.dropped_groups} groups were "
                f"voided by infrastructure failures (sandbox errors, lost sessions) even after "
                f"{self.spec.triage.retries} retries each; check the sandbox pool's health")
        if fallback > len(uniform):
            raise AssertionError(f"step {step + 1}: {len(kept)} groups for {self.per_rank}")
        chosen = kept[: self.per_rank] + uniform[len(uniform) - fallback:] if fallback else \
            kept[: self.per_rank]
        if self.bound:
            self.pool = kept[self.per_rank:]
        names = sorted(set().union(*(g.components for g in chosen)))
        counts = {
            "filter/uniform_groups": float(len(uniform)),
            "filter/fallback_groups": float(fallback),
            "filter/rounds": float(rounds),
            "async/stale_dropped": float(stale * group),
            "curriculum/band_skipped": float(self.sampler.band_skipped),
            "curriculum/tracked_tasks": float(len(self.sampler.buffer.entries)),
            "curriculum/replayed": float(self.sampler.replayed),
            "curriculum/replay_size": float(len(self.sampler.replay)),
            **played,
        }
        triage.add_to(counts)
        return StepBatch(
            step=step,
            batch=merge([g.batch for g in chosen], self.pad_id),
            rewards=torch.tensor([r for g in chosen for r in g.rewards], dtype=torch.float32),
            components={k: [x for g in chosen
                            for x in g.components.get(k, [0.0] * len(g.rewards))]
                        for k in names},
            versions=[g.version for g in chosen],
            sampler_state=self.sampler.state_dict(),
            counts=counts,
            gen_s=gen_s,
            prompts=[g.example.prompt for g in chosen for _ in g.rewards],
        )


class WeightStore:
    """Versioned weight hand-off from the learner to the actor. The learner publishes a full
    state dict (fresh tensors, never mutated afterwards) with its version."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version = -1
        self.state: dict[str, torch.Tensor] | None = None
        self.closed = False

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self.version, self.state = version, state
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait(self, min_version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        """The latest weights once their version is >= min_version; AsyncStall on timeout."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.version >= min_version or self.closed,
                                     timeout)
            if self.closed:
                raise AsyncStall("weight store closed")
            if not ok or self.state is None:
                raise AsyncStall(
                    f"actor waited {timeout:.1f} s for policy weights of version >= "
                    f"{min_version}; the learner last published version {self.version} "
                    "(trainer.sync_timeout_s)"
                )
            return self.version, self.state


class _Stop(Exception):
    pass


class AsyncActor(threading.Thread):
    """Runs the producer for steps [start, total) on its own policy copy, at most `bound`
    versions behind the learner, handing batches over through a bounded queue."""

    def __init__(self, producer: Producer, model: torch.nn.Module | None,
                 backend: RolloutBackend, store: WeightStore, start: int, total: int,
                 bound: int, timeout: float,
                 loader: Callable[[int, dict[str, torch.Tensor]], None] | None = None):
        """`loader(version, state)` puts a published snapshot into the backend; by default
        into `model` (which the backend samples from)."""
        super().__init__(name="rl-actor", daemon=True)
        self.producer, self.model, self.backend = producer, model, backend
        self.loader = loader or self._load_into_model
        self.store, self.start_step, self.total = store, start, total
        self.bound, self.timeout = bound, timeout
        self.batches: queue.Queue[StepBatch | BaseException] = queue.Queue(maxsize=bound)
        self._stop_event = threading.Event()
        self.loaded = -1
        self.idle_s = 0.0
        self.busy_s = 0.0

    def _weights(self, min_version: int) -> tuple[int, RolloutBackend]:
        t0 = time.perf_counter()
        version, state = self.store.wait(min_version, self.timeout)
        self.idle_s += time.perf_counter() - t0
        if version != self.loaded:
            self.loader(version, state)
            self.loaded = version
        return version, self.backend

    def _load_into_model(self, version: int, state: dict[str, torch.Tensor]) -> None:
        assert self.model is not None, "an actor without a model needs its own loader"
        load_weights(self.model, state)  # full, or a LoRA policy's adapters only
        self.backend.sync_weights(self.model)  # a no-op for HF; a push for a server

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """The learner's weights after its `version`-th update (`RolloutSource.publish`)."""
        self.store.publish(version, state)

    def _put(self, item: StepBatch | BaseException) -> None:
        t0 = time.perf_counter()
        while not self._stop_event.is_set():
            try:
                self.batches.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        self.idle_s += time.perf_counter() - t0
        if self._stop_event.is_set():
            raise _Stop

    def run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            for step in range(self.start_step, self.total):
                idle0, t0 = self.idle_s, time.perf_counter()
                floor = max(0, step - self.bound)
                # Later rounds of the same step take whatever is newest, never older.
                def newest(f: int = floor) -> tuple[int, RolloutBackend]:
                    return self._weights(max(f, self.loaded))

                sb = self.producer.produce(step, newest)
                sb.gen_idle_s = self.idle_s - idle0
                self.busy_s += time.perf_counter() - t0 - sb.gen_idle_s
                self._put(sb)
        except _Stop:
            return
        except BaseException as err:  # handed to the learner, which re-raises it
            try:
                self._put(err)
            except _Stop:
                return

    def get(self, step: int) -> StepBatch:
        """The batch for `step`; re-raises an actor failure; AsyncStall on timeout. The learner
        waits twice the actor's weight timeout, so a stalled weight sync is reported as such."""
        try:
            item = self.batches.get(timeout=2 * self.timeout)
        except queue.Empty:
            raise AsyncStall(
                f"learner waited {2 * self.timeout:.1f} s for the rollout batch of step "
                f"{step + 1}; the actor is alive={self.is_alive()} (trainer.sync_timeout_s)"
            ) from None
        if isinstance(item, BaseException):
            raise item
        if item.step != step:
            raise AsyncStall(f"actor handed over step {item.step + 1} for step {step + 1}")
        return item

    def stop(self) -> None:
        self._stop_event.set()
        self.store.close()
        self.join(timeout=self.timeout)


class RolloutSource(Protocol):
    """Where the learner's batches come from when it does not sample itself: the in-process
    `AsyncActor`, or a rollout actor in another process (`workers.cluster.rollouts`)."""

    def get(self, step: int) -> StepBatch: ...

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None: ...

    def stop(self) -> None: ...


@dataclass
class RolloutSetup:
    """Everything a rollout actor in another process needs to produce a rank's batches as the
    in-process actor would: the rank's producer (its curriculum sampler restored, its seeds),
    how to build the policy copy it samples with, and the run's version bounds. Picklable."""

    producer: Producer
    model_spec: ModelSpec
    tokenizer: Any
    start: int  # the first step to produce (the resumed step)
    total: int  # the run's steps
    bound: int  # trainer.max_async_steps
    timeout: float  # trainer.sync_timeout_s
    bf16: bool
    aux_free: bool  # MoE selection bias: it arrives with the weights
    vllm_dir: str | None = None  # vLLM: the directory its engine starts from (else HF)
    vllm: Any = None  # the run's VllmSpec when vllm_dir is set
    engine: str = "batch"  # rollout.engine of the hf backend (else vLLM's own scheduler)


class RolloutLauncher(Protocol):
    """Starts a rank's out-of-process rollout side from its setup and first weights."""

    def start(self, setup: RolloutSetup, weights: dict[str, torch.Tensor]) -> RolloutSource: ...


def rollout_copy(model_spec: ModelSpec, tok: Any, device: torch.device, bf16: bool,
                 aux_free: bool) -> torch.nn.Module:
    """The actor's own plain (unsharded) policy copy, in eval mode, refreshed from the
    versioned snapshots the learner publishes."""
    model = build_policy(model_spec, len(tok), tok.pad_token_id,
                         tok.eos_token_id).to(device).eval()  # type: ignore[arg-type]
    if bf16:
        model = model.to(torch.bfloat16)
    if aux_free:  # the per-expert bias arrives with the weights
        balance.attach(replayable_routers(model) or [])
    return model
