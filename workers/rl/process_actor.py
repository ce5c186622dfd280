"""The rollout actor in a child process on the same host (`trainer.async_actor = "process"`).

The in-process actor (`workers.rl.actor.AsyncActor`) is a thread: it overlaps generation with
training only while one of them waits outside the GIL, so on a small model, where every torch
call is short and the Python around it is most of the time, the two mostly take turns. Here
the same producer (its curriculum sampler, its seeds, the same `Producer.produce`) runs in a
`spawn`ed child on its own policy copy, and the learner only trains:

- Weights go learner -> child through shared memory (`SharedWeights`): one flat buffer per
  dtype in each of two slots, written in turn after every update as version `step + 1` under
  a sequence number, so the child never keeps a version read half-written and no lock is
  shared. The child samples step n only with a version >= n - max_async_steps and takes
  versions only upwards, as the thread does.
- Batches go child -> learner as pickled `StepBatch`es over a pipe, in step order; an error in
  the child travels the same way and is raised in the learner with the child's traceback
  attached. A child that dies is named with its exit code; a hand-off that does not happen in
  `trainer.sync_timeout_s` raises `AsyncStall`, as in-process.

Ray runs (`cluster.rollout_actors`, `workers.cluster.rollouts`) place such actors on other
nodes; this is the one-host form, with no server and nothing to install.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from workers import threads
from workers.rl.actor import AsyncStall, RolloutSetup, StepBatch
from workers.rl.weight_layout import check, empty_buckets, layout_of, unflatten

SETUP_TIMEOUT_S = 600.0  # spawning the child: imports torch and transformers, builds the copy
POLL_S = 0.5  # how often a waiting side looks whether the other is still alive


class RolloutProcessFailed(RuntimeError):
    """The rollout process died, or could not be started."""


class SharedWeights:
    """The learner's latest weights in shared memory, with their version. Built by the learner
    from its first snapshot (the layout every later one must keep) and handed to the child at
    spawn: the buffers and counters are shared, not copied.

    No lock is shared with the child: a lock (or a `multiprocessing.Condition`, whose notify
    waits for every sleeper to wake) held or slept on by a child that is then killed would hang
    the learner. Instead two slots are written in turn, each under a sequence number that is odd
    while it is written (a seqlock): the writer never waits, and a reader that finds the number
    odd or changed across its copy copies again. A pipe rings the child awake for each version.
    """

    def __init__(self, state: dict[str, torch.Tensor], ctx: Any) -> None:
        self.layout = layout_of(state, bucket_bytes=1 << 62)  # one buffer per dtype
        self.buffers = [[b.share_memory_() for b in empty_buckets(self.layout)]
                        for _ in range(2)]
        self.seq = ctx.Array("q", 2, lock=False)  # per slot: odd while being written
        self.stamp = ctx.Array("q", [-1, -1], lock=False)  # per slot: the version it holds
        self.latest = ctx.Value("q", -1, lock=False)  # the slot written last
        self.version = ctx.Value("q", -1, lock=False)
        self.closed = ctx.Value("b", 0, lock=False)
        self.bell_in, self.bell_out = ctx.Pipe(duplex=False)

    def views(self, slot: int = 0) -> dict[str, torch.Tensor]:
        """Each weight as a view into one slot's buffers (made once per process)."""
        made = self.__dict__.setdefault("_views", {})
        if slot not in made:
            made[slot] = unflatten(self.buffers[slot], self.layout)
        return made[slot]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_views"}

    def write(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Publish `state` as `version` (the learner only). Its names, shapes and dtypes must be
        the first snapshot's: a rollout copy is built once."""
        try:
            check(state, self.layout)
        except ValueError as exc:
            raise ValueError(f"weight version {version} does not fit the rollout process's "
                             f"copy: {exc}") from None
        slot = 1 - self.latest.value if self.latest.value >= 0 else 0
        views = self.views(slot)
        self.seq[slot] += 1  # odd: a reader of this slot copies again
        for name, t in state.items():
            views[name].copy_(t)
        self.stamp[slot] = version
        self.seq[slot] += 1
        self.latest.value = slot
        self.version.value = version
        self.ring()

    def ring(self) -> None:
        # One small message per version; the child drains them whenever it waits. The
        # learner keeps its own reading end open, so a dead child cannot make this raise.
        self.bell_out.send_bytes(b"")

    def close(self) -> None:
        self.closed.value = 1
        self.ring()

    def read(self, min_version: int, loaded: int, timeout: float,
             load: Callable[[int, dict[str, torch.Tensor]], None],
             alive: Callable[[], bool] = lambda: True) -> int:
        """Wait for a version >= `min_version`, give it to `load` unless it is `loaded`
        already, and return it; the copy is repeated until no write overlapped it. AsyncStall
        after `timeout`, when closed, or when `alive()` turns false."""
        deadline = time.monotonic() + timeout
        while True:
            if self.closed.value:
                raise AsyncStall("weight store closed")
            if self.version.value >= min_version:
                slot = self.latest.value
                before = self.seq[slot]
                if before % 2 == 0:
                    version = int(self.stamp[slot])
                    if version == loaded:
                        return version
                    load(version, self.views(slot))
                    if self.seq[slot] == before:
                        return version
                continue  # overwritten while read: read the newer one
            left = deadline - time.monotonic()
            if left <= 0:
                raise AsyncStall(
                    f"rollout process waited {timeout:.1f} s for policy weights of version >= "
                    f"{min_version}; the learner last published version {self.version.value} "
                    "(trainer.sync_timeout_s)")
            if not alive():
                raise AsyncStall("the learner process is gone")
            if self.bell_in.poll(min(left, POLL_S)):
                while self.bell_in.poll(0):
                    self.bell_in.recv_bytes()


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).view(shape)


class _BatchPickler(pickle.Pickler):
    """Pickles plain CPU tensors as their bytes, dtype and shape. torch's own reduction
    rebuilds each storage through its serialization machinery, ~0.15 ms a tensor: most of what
    handing a step's batch over cost the learner."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu" \
                and not obj.requires_grad:
            flat = obj.detach().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor, (data, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """`obj` pickled for the pipe, tensors by value (`_BatchPickler`)."""
    buf = io.BytesIO()
    _BatchPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _portable(err: BaseException) -> BaseException:
    """`err` with the child's traceback attached, or a RuntimeError naming it when the
    exception does not survive pickling (a class with required keyword arguments)."""
    where = "in the rollout process:\n" + "".join(traceback.format_exception(err)).rstrip()
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a description
        return RuntimeError(f"{type(err).__name__}: {err}\n{where}")
    err.add_note(where)
    return err


def _serve(setup_blob: bytes, weights: SharedWeights, conn: Connection, parent: int,
           sharers: int) -> None:
    """The child: build the policy copy and backend, then produce steps [start, total)."""
    threads.configure(sharers, role="rollout process")  # it shares the cores with the learner
    torch.set_grad_enabled(False)

    def alive() -> bool:
        return os.getppid() == parent

    try:
        from workers.rl.actor import rollout_copy
        from workers.rl.lora import load_weights
        from workers.rl.rollout import make_backend

        setup: RolloutSetup = pickle.loads(setup_blob)
        model = rollout_copy(setup.model_spec, setup.tokenizer, torch.device("cpu"),
                             setup.bf16, setup.aux_free)
        backend = make_backend("hf", model, setup.tokenizer, False, setup.engine)
        conn.send_bytes(pickle.dumps(("ready", torch.get_num_threads())))

        def load(version: int, state: dict[str, torch.Tensor]) -> None:
            load_weights(model, state)
            backend.sync_weights(model)  # the continuous engine drops its cached keys

        loaded, idle = -1, 0.0
        for step in range(setup.start, setup.total):
            floor, idle0 = max(0, step - setup.bound), idle

            def newest(f: int = floor) -> tuple[int, Any]:
                nonlocal loaded, idle
                t0 = time.perf_counter()
                loaded = weights.read(max(f, loaded), loaded, setup.timeout, load, alive)
                idle += time.perf_counter() - t0
                return loaded, backend

            sb = setup.producer.produce(step, newest)
            sb.gen_idle_s = idle - idle0
            conn.send_bytes(dumps(("batch", sb)))
    except AsyncStall as err:
        if weights.closed.value or not alive():
            return  # stopped by the learner, or orphaned: nobody is waiting
        _send_error(conn, err)
    except BaseException as err:  # handed to the learner, which raises it
        _send_error(conn, err)


def _send_error(conn: Connection, err: BaseException) -> None:
    with contextlib.suppress(OSError, EOFError):  # the learner is gone or stopped reading
        conn.send_bytes(pickle.dumps(("error", _portable(err))))


class ProcessSource:
    """The learner's side of one rollout process (`workers.rl.actor.RolloutSource`)."""

    copies = True  # `publish` copies the state before it returns: it may be the live weights

    def __init__(self, proc: Any, conn: Connection, weights: SharedWeights,
                 timeout: float, threads_before: dict[str, Any]) -> None:
        self.proc, self.conn, self.weights, self.timeout = proc, conn, weights, timeout
        self.threads_before = threads_before  # the learner's, restored at stop
        self.child_threads = 0  # the child's torch threads, once it is ready

    def _died(self, when: str) -> RolloutProcessFailed:
        return RolloutProcessFailed(f"the rollout process (pid {self.proc.pid}) exited with "
                                    f"code {self.proc.exitcode} {when}")

    def receive(self, timeout: float, what: str) -> tuple[str, Any]:
        """The child's next message; raises its error, names its death, stalls on timeout."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(POLL_S):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise self._died(f"before handing over {what}")
            if time.monotonic() > deadline:
                raise AsyncStall(f"learner waited {timeout:.1f} s for {what} from the rollout "
                                 f"process (pid {self.proc.pid}, alive) "
                                 "(trainer.sync_timeout_s)")
        try:
            kind, payload = pickle.loads(self.conn.recv_bytes())
        except EOFError:
            raise self._died(f"before handing over {what}") from None
        if kind == "error":
            raise payload
        return kind, payload

    def get(self, step: int) -> StepBatch:
        kind, sb = self.receive(2 * self.timeout, f"the rollout batch of step {step + 1}")
        if kind != "batch" or sb.step != step:
            raise AsyncStall(f"rollout process handed over {kind} "
                             f"{getattr(sb, 'step', -1) + 1} for step {step + 1}")
        return sb

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if not self.proc.is_alive():
            raise self._died(f"before taking weight version {version}")
        self.weights.write(version, state)

    def stop(self) -> None:
        """Stop the child (it leaves any wait for weights at once) and reap it."""
        self.weights.close()
        self.proc.join(timeout=5.0)
        if self.proc.is_alive():  # busy generating, or blocked on a full pipe
            self.proc.terminate()
            self.proc.join(timeout=5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        threads.restore(self.threads_before)


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a Celery prefork pool process start the child. Its pool (billiard) leaves two
    marks on multiprocessing's record of the current process: it is daemonic, which
    multiprocessing refuses children to (so that they are not orphaned when it is killed;
    this child exits by itself once its parent is gone, the `alive()` check of its waits,
    and is otherwise stopped and reaped by the trainer), and its auth key is billiard's type,
    which refuses to be pickled into the spawn. Both are set plainly for the start and put
    back at once; there is no public API for either."""
    current = multiprocessing.current_process()
    config = current._config  # type: ignore[attr-defined]
    saved = dict(config)
    config["daemon"] = False
    # billiard replaces multiprocessing's current-process record with its own, whose key
    # setter makes billiard's type again: store multiprocessing's own type directly.
    config["authkey"] = multiprocessing.process.AuthenticationString(  # type: ignore[attr-defined]
        bytes(current.authkey))
    try:
        yield
    finally:
        config.clear()
        config.update(saved)


class ProcessRollouts:
    """`workers.rl.actor.RolloutLauncher` for one host: spawns the rank's rollout process and
    returns once its policy copy is built, so a run's timed steps start with the actor ready
    (as the thread is)."""

    def start(self, setup: RolloutSetup, weights: dict[str, torch.Tensor]) -> ProcessSource:
        if setup.vllm_dir is not None:
            raise ValueError("trainer.async_actor = 'process' samples with the 'hf' backend")
        try:
            blob = pickle.dumps(setup, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - pickling can fail in many ways
            raise ValueError(f"trainer.async_actor = 'process' sends the run's producer to a "
                             f"child process, and it could not be pickled ({exc}); use "
                             "trainer.async_actor = 'thread'") from exc
        ctx = mp.get_context("spawn")  # not fork: the parent may hold threads and locks
        shared = SharedWeights(weights, ctx)
        shared.write(setup.start, weights)
        ours, theirs = ctx.Pipe(duplex=False)
        # The learner and its rollout process split what the learner had (CRUCIBLE_THREADS,
        # when set, stays each one's): two processes of N threads on N cores would spin
        # against each other.
        before = threads.in_use()
        share = 2 * threads.sharers()
        with _children_allowed():  # the process copies the record it is made from
            proc = ctx.Process(target=_serve, args=(blob, shared, theirs, os.getpid(), share),
                               name="crucible-rollout", daemon=False)
            proc.start()
        theirs.close()
        threads.configure(share, role="learner beside its rollout process")  # once it runs
        source = ProcessSource(proc, ours, shared, setup.timeout, before)
        try:
            _, source.child_threads = source.receive(max(SETUP_TIMEOUT_S, setup.timeout),
                                                     "its ready signal")
        except BaseException:
            source.stop()
            raise
        return source
