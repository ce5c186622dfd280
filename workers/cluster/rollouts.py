"""Rollout actors of a Ray run (``cluster.rollout_actors``): one Ray actor per learner rank,
on a placement bundle of its own, running the rank's producer (its curriculum sampler, its
seeds, the rollout backend: HF on CPU, vLLM on GPU) on its own policy copy, exactly as the
in-process asynchronous actor thread does (``workers.rl.actor.AsyncActor``, reused here).

- Batches travel actor → rank as Ray objects: the rank asks for step n's batch
  (:meth:`RolloutSource.get`), and each carries the weight version of every group.
- Weights travel rank → actor over a two-process ``torch.distributed`` group of their own
  (``workers.cluster.weights``: flat buckets, gloo on CPU, NCCL on GPU), after every update,
  as version ``step + 1``. The actor samples step n only with a version >= n - max_async_steps
  (the in-process bound: 0 means the weights of step n exactly) and takes versions only
  upwards.
- A push not taken within ``cluster.push_timeout_s`` raises :class:`WeightPushTimeout` naming
  the actor; an actor that dies fails the attempt with :class:`RolloutFailed` naming it (the
  driver watches every actor, so a lost node is noticed even while the rank is training).
- With ``cluster.verify_pushes`` both ends hash every push, and the actor hashes its policy
  copy after loading each version: a difference fails the run (:class:`WeightMismatch`).

This module and ``workers.cluster.ray_job`` are the only ones that import Ray.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from workers.cluster.weights import (
    Layout,
    WeightChannel,
    WeightMismatch,
    WeightPushTimeout,
    checksum,
    flatten,
    layout_of,
    unflatten,
)
from workers.rl.actor import AsyncStall, RolloutSetup, StepBatch

CALL_TIMEOUT_S = 60.0  # a small call to an actor (where, stop, loads)
SETUP_TIMEOUT_S = 900.0  # building an actor's policy copy: a vLLM engine takes minutes


class RolloutFailed(RuntimeError):
    """A rollout actor of a multi-node attempt died (its process or node) or failed. Retryable
    when it died: the next attempt places a new one."""

    def __init__(self, index: int, where: str, detail: str, *, died: bool) -> None:
        super().__init__(f"rollout actor {index} ({where}) {'died' if died else 'failed'}: "
                         f"{detail}")
        self.index, self.where, self.detail, self.died = index, where, detail, died
        self.retryable = died

    def __reduce__(self) -> tuple[Any, ...]:
        return (RolloutFailed._rebuild, (self.index, self.where, self.detail, self.died))

    @staticmethod
    def _rebuild(index: int, where: str, detail: str, died: bool) -> RolloutFailed:
        return RolloutFailed(index, where, detail, died=died)


def describe(place: dict[str, Any]) -> str:
    """Where an actor runs, as failures name it (the ranks' format)."""
    return f"node {str(place['node_id'])[:12]} at {place['ip']}, pid {place['pid']}"


def free_endpoint() -> tuple[str, int]:
    """This node's IP and a free port on it, for the weight channel's store."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


# -- the actor ------------------------------------------------------------------------------------

@ray.remote(max_restarts=0, max_task_retries=0)
class RolloutActor:
    """One rank's rollout side in its own Ray worker process. Threaded (``max_concurrency``):
    the producer thread samples while pushes arrive and batches are taken, and ``serve``
    blocks for the driver's watch until the actor is stopped."""

    def __init__(self, index: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        from workers import threads

        threads.configure(1, role=f"rollout actor {index}")
        self.index = index
        self.stopped = threading.Event()
        self.actor: Any = None  # workers.rl.actor.AsyncActor once set up
        self.channel: WeightChannel | None = None
        self.layout: Layout | None = None
        self.verify = False
        self.received: dict[int, str] = {}  # version -> checksum of what arrived
        self.loaded: dict[int, str] = {}  # version -> checksum of the policy copy after load
        self.lock = threading.Lock()  # pushes one at a time

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"rollout_actor": self.index, "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid()}

    def setup(self, setup: RolloutSetup, layout: Layout, verify: bool) -> None:
        """Build the policy copy and the backend, and start the producer thread (it waits for
        the first push)."""
        from workers.rl.actor import AsyncActor, WeightStore, rollout_copy
        from workers.rl.distributed import on_cuda
        from workers.rl.lora import load_weights
        from workers.rl.rollout import make_backend

        torch.set_grad_enabled(False)
        self.layout, self.verify = layout, verify
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if on_cuda()
                                   else "cpu")
        store = WeightStore()
        model: torch.nn.Module | None = None
        if setup.vllm_dir is not None:
            from workers.rl.vllm_rollout import VllmRollout

            # The directory's weights are no version the rank published (on a resume they
            # are older): the first push, version `start`, replaces them.
            backend: Any = VllmRollout(setup.vllm_dir, setup.tokenizer, setup.vllm,
                                       version=-1)

            def load(version: int, state: dict[str, torch.Tensor]) -> None:
                backend.load_state(state, version)
                self._loaded(version, None)
        else:
            model = rollout_copy(setup.model_spec, setup.tokenizer, self.device, setup.bf16,
                                 setup.aux_free)
            backend = make_backend("hf", model, setup.tokenizer, False, setup.engine)
            copy_ = model

            def load(version: int, state: dict[str, torch.Tensor]) -> None:
                load_weights(copy_, state)
                backend.sync_weights(copy_)  # the continuous engine drops its cached keys
                self._loaded(version, copy_)

        self.actor = AsyncActor(setup.producer, model, backend, store, setup.start,
                                setup.total, setup.bound, setup.timeout, loader=load)
        self.actor.start()

    def _loaded(self, version: int, model: torch.nn.Module | None) -> None:
        """With verify_pushes: the policy copy after loading `version` must hash as what
        arrived (a vLLM engine holds its weights itself: recorded as received)."""
        if not self.verify or self.layout is None:
            return
        sent = self.received.get(version)
        got = sent or ""
        if model is not None:
            state = {k: v for k, v in model.state_dict().items()
                     if k in {s.name for s in self.layout.slots}}
            got = checksum(flatten(state, self.layout, self.device))
        if got != sent:
            raise WeightMismatch(f"rollout actor {self.index}: its policy copy after loading "
                                 f"version {version} hashes {got}, the push {sent}")
        self.loaded[version] = got

    def connect(self, host: str, port: int, timeout_s: float) -> None:
        """Join the learner's weight channel (the learner joins at the same time)."""
        self.channel = WeightChannel(host, port, rank=1, timeout_s=timeout_s, device=self.device)

    def receive(self, version: int) -> str | None:
        """Take one push (the learner broadcasts it now) as weight `version`: only upwards.
        Returns the checksum of what arrived when verifying."""
        assert self.channel is not None and self.layout is not None and self.actor is not None
        with self.lock:
            buckets = self.channel.recv(self.layout)
            store = self.actor.store
            if version <= store.version:
                raise ValueError(f"rollout actor {self.index} holds weight version "
                                 f"{store.version} and refuses the older or equal {version}")
            digest = checksum(buckets) if self.verify else None
            if digest is not None:
                self.received[version] = digest
            store.publish(version, unflatten(buckets, self.layout))
            return digest

    def next(self, step: int) -> StepBatch:
        """Step `step`'s batch (waits for it; AsyncStall after twice trainer.sync_timeout_s)."""
        assert self.actor is not None, "the actor was never set up"
        return self.actor.get(step)

    def serve(self) -> None:
        """Returns once the actor is stopped: the driver watches it to notice a lost actor."""
        self.stopped.wait()

    def loads(self) -> dict[int, str]:
        return dict(self.loaded)

    def stop(self) -> None:
        if self.actor is not None:
            self.actor.stop()
        self.stopped.set()


# -- the learner's side ---------------------------------------------------------------------------

@dataclass
class RemoteSource:
    """A rank's rollout actor as the trainer sees it (``workers.rl.actor.RolloutSource``)."""

    actor: Any
    index: int
    where: str
    channel: WeightChannel
    layout: Layout
    device: torch.device
    push_timeout_s: float
    batch_timeout_s: float
    verify: bool
    pushes: list[dict[str, Any]] = field(default_factory=list)  # with verify: per version

    def _lost(self, exc: BaseException) -> RolloutFailed:
        return RolloutFailed(self.index, self.where, f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:300]}", died=True)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Push `state` as weight `version`; raise naming the actor unless it took it in time
        (and, verifying, bitwise)."""
        buckets = flatten(state, self.layout, self.device)
        ref = self.actor.receive.remote(version)
        what = f"rollout actor {self.index} ({self.where}) did not take weight version {version}"
        try:
            self.channel.send(buckets)
            got = ray.get(ref, timeout=self.push_timeout_s)
        except WeightPushTimeout as exc:
            raise WeightPushTimeout(f"{what}: {exc}") from exc
        except GetTimeoutError as exc:
            raise WeightPushTimeout(f"{what} within cluster.push_timeout_s = "
                                    f"{self.push_timeout_s:.0f} s") from exc
        except RayActorError as exc:
            raise self._lost(exc) from exc
        except RayTaskError as exc:
            raise RolloutFailed(self.index, self.where, str(exc.cause), died=False) from exc
        if self.verify:
            mine = checksum(buckets)
            if got != mine:
                raise WeightMismatch(f"rollout actor {self.index} ({self.where}) received "
                                     f"weight version {version} hashing {got}; sent {mine}")
            self.pushes.append({"version": version, "learner": mine, "actor": got})

    def get(self, step: int) -> StepBatch:
        try:
            return ray.get(self.actor.next.remote(step), timeout=self.batch_timeout_s)
        except GetTimeoutError as exc:
            raise AsyncStall(f"rollout actor {self.index} ({self.where}) handed over no batch "
                             f"for step {step + 1} within {self.batch_timeout_s:.0f} s") from exc
        except RayActorError as exc:
            raise self._lost(exc) from exc
        except RayTaskError as exc:  # the producer's own error (AsyncStall, the objective's)
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise cause from exc

    def stop(self) -> None:
        """Stop the producer; with verify, keep the actor's per-version load checksums."""
        try:
            if self.verify:
                loaded = ray.get(self.actor.loads.remote(), timeout=CALL_TIMEOUT_S)
                for push in self.pushes:
                    push["loaded"] = loaded.get(push["version"])
            ray.get(self.actor.stop.remote(), timeout=CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError, RayTaskError):
            pass  # the driver reports a lost actor itself; stopping is best effort


@dataclass
class RemoteRollouts:
    """``workers.rl.actor.RolloutLauncher`` for one rank: sets its actor up, opens the
    weight channel, and makes the first push (the resumed step's weights)."""

    actor: Any
    index: int
    place: dict[str, Any]
    push_timeout_s: float
    bucket_bytes: int
    verify: bool
    source: RemoteSource | None = None

    def start(self, setup: RolloutSetup, weights: dict[str, torch.Tensor]) -> RemoteSource:
        from workers.rl.distributed import on_cuda

        where = describe(self.place)
        layout = layout_of(weights, self.bucket_bytes)
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if on_cuda() else "cpu")
        try:
            ray.get(self.actor.setup.remote(setup, layout, self.verify),
                    timeout=SETUP_TIMEOUT_S)
            host, port = free_endpoint()
            joined = self.actor.connect.remote(host, port, self.push_timeout_s)
            channel = WeightChannel(host, port, rank=0, timeout_s=self.push_timeout_s,
                                    device=device)
            ray.get(joined, timeout=self.push_timeout_s)
        except GetTimeoutError as exc:
            raise WeightPushTimeout(f"rollout actor {self.index} ({where}) was not set up "
                                    f"and connected in time ({exc})") from exc
        except RayActorError as exc:
            raise RolloutFailed(self.index, where, str(exc).splitlines()[0][:300],
                                died=True) from exc
        except RayTaskError as exc:
            raise RolloutFailed(self.index, where, f"set-up failed: {exc.cause}",
                                died=False) from exc
        self.source = RemoteSource(self.actor, self.index, where, channel, layout, device,
                                   self.push_timeout_s, 2 * setup.timeout, self.verify)
        self.source.publish(setup.start, weights)
        return self.source

    def pushes(self) -> list[dict[str, Any]]:
        return list(self.source.pushes) if self.source is not None else []
