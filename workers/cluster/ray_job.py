"""One multi-node train attempt as a Ray job: a placement group with one bundle per node
(``STRICT_SPREAD``), one Ray actor per rank running the existing engine
(``workers.rl.trainer.train``) with the torch.distributed rendezvous (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set from the placement, gloo on CPU and NCCL on GPU.

The caller (a worker's train adapter, a test) stays the driver and keeps the run's reporter:

- rank 0's reports travel through a small relay actor on the driver's node and are forwarded
  to the caller's reporter in order; a checkpoint report waits until the driver has forwarded
  it (the worker uploads and records it), as it does in-process;
- the driver asks the reporter ``should_stop()`` / ``preempted()`` and hands the answer to
  rank 0 through the relay; the engine agrees the stop across ranks (``Trainer.agreed_stop``).
  A reporter that raises ``Stopped`` (a lost lease) raises in the driver, never inside a rank
  mid-step: the ranks are told to stop at their next safe point instead;
- every rank's printed output is streamed back as run events (``rank <r>: <line>``);
- a rank that raises, or dies with its process or node, fails the attempt with
  :class:`RankFailed` naming the rank and where it ran (never a hang: the surviving ranks are
  killed; their collectives are also bounded by ``CRUCIBLE_DIST_TIMEOUT_S``);
- a finished attempt must have trained every step from its resume point to the end
  (``workers.cluster.progress``);
- with ``cluster.rollout_actors`` each rank gets a rollout actor on a bundle of a second
  placement group (``workers.cluster.rollouts``): the rank trains, the actor samples, weights
  are pushed rank → actor after every update; the driver watches the actors too, so a lost
  actor fails the attempt naming it.

Ray is imported here only; the checkpoint folder must be one all nodes see (the same path on
shared storage), since ZeRO writes one shard per rank and a resumed rank may land elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayError,
    RayTaskError,
)
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from workers.cluster.plan import ClusterPlan
from workers.cluster.progress import check_trained
from workers.cluster.rollouts import RemoteRollouts, RolloutActor, RolloutFailed, describe
from workers.reporting import Reporter, Stopped

MAX_LINE = 2000  # characters of one output line kept as an event
MAX_BUFFERED = 5000  # output lines the relay holds before it drops (and counts) the rest
CALL_TIMEOUT_S = 60.0  # any single call to the relay or an actor's small method


class RankFailed(RuntimeError):
    """A rank of a multi-node attempt failed: it raised (``cause``), or its process or node
    died (``died``). Retryable when the rank died or hit an infrastructure error (a lost
    node, a collective timeout); final when its own code raised a deterministic error."""

    def __init__(self, rank: int, where: str, detail: str, *, died: bool,
                 cause: BaseException | None = None) -> None:
        super().__init__(f"rank {rank} ({where}) {'died' if died else 'failed'}: {detail}")
        self.rank, self.where, self.detail, self.died, self.cause = rank, where, detail, died, cause
        self.retryable = died or _retryable_cause(cause)

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable (Celery and Ray pickle exceptions) without the cause, which may not be."""
        return (_rank_failed, (self.rank, self.where, self.detail, self.died, self.retryable))


def _rank_failed(rank: int, where: str, detail: str, died: bool, retryable: bool) -> RankFailed:
    exc = RankFailed(rank, where, detail, died=died)
    exc.retryable = retryable
    return exc


def _retryable_cause(cause: BaseException | None) -> bool:
    """Whether the exception a rank raised is worth another attempt: its own ``retryable``
    flag, else final for the engine's deterministic errors (matched by name), retryable for
    infrastructure (I/O, timeouts, runtime errors such as a collective's)."""
    flag = getattr(cause, "retryable", None)
    if isinstance(flag, bool):
        return flag
    final = {"TrainingFailed", "SpecError", "ModelDirError", "PinnedDataError", "IncompleteRun"}
    if any(c.__name__ in final for c in type(cause).__mro__):
        return False
    return isinstance(cause, OSError | TimeoutError | RuntimeError)


class PlacementFailed(RuntimeError):
    """The cluster could not place the gang within the plan's timeout (too few nodes alive,
    or the allocation's nodes missing from Ray). Retryable: nodes come back."""

    retryable = True


@dataclass
class JobResult:
    """What a finished multi-node attempt hands back."""

    start: int  # the step it resumed from (0 for a fresh run)
    steps: int  # the run's last trained step
    trained: list[int]  # the steps this attempt trained
    losses: dict[int, float] = field(default_factory=dict)
    placement: list[dict[str, Any]] = field(default_factory=list)  # per rank: node, ip
    rollouts: list[dict[str, Any]] = field(default_factory=list)  # per rollout actor: node, ip
    # With cluster.verify_pushes, per rank: each push's version and the checksums of what the
    # rank sent, what its actor received and (once sampled with) its policy copy.
    pushes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


# -- the relay: rank 0's reports and the driver's stop, in order --------------------------------

@ray.remote(num_cpus=0, max_restarts=0)
class Relay:
    """A mailbox between the ranks and the driver. One caller's calls run in the order they
    were made (a plain Ray actor), so rank 0's reports reach the driver in the engine's order."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.first = 0  # index of records[0] in the stream (the driver takes and trims)
        self.acked: set[int] = set()
        self.stop: tuple[bool, bool] = (False, False)  # (should_stop, preempted)
        self.dropped = 0

    def put(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "output" and len(self.records) >= MAX_BUFFERED:
            self.dropped += 1
            return
        self.records.append(record)

    def take(self, after: int) -> tuple[list[dict[str, Any]], int, int]:
        """Records from stream index ``after`` on, the next index, and lines dropped so far."""
        skip = max(after - self.first, 0)
        out = self.records[skip:]
        self.first += len(self.records)
        self.records = []
        return out, self.first, self.dropped

    def ack(self, ident: int) -> None:
        self.acked.add(ident)

    def is_acked(self, ident: int) -> bool:
        return ident in self.acked

    def set_stop(self, stop: bool, preempted: bool) -> None:
        self.stop = (stop, preempted)

    def get_stop(self) -> tuple[bool, bool]:
        return self.stop


class RelayReporter:
    """Rank 0's reporter: every call goes to the relay; a checkpoint waits for the driver's
    acknowledgement (the folder must not be pruned before it is uploaded). Never raises
    ``Stopped``: the stop reaches the engine through ``should_stop()`` at its safe points."""

    def __init__(self, relay: Any, ack_timeout_s: float) -> None:
        self.relay, self.ack_timeout_s = relay, ack_timeout_s
        self.next_id = 0
        self.preempt = False

    def _put(self, record: dict[str, Any]) -> None:
        self.relay.put.remote(record)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._put({"kind": "log", "step": step, "metrics": dict(metrics)})

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._put({"kind": "event", "level": level, "message": message, "data": data or {}})

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._put({"kind": "samples", "step": step, "rows": rows})

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        ident, self.next_id = self.next_id, self.next_id + 1
        self._put({"kind": "checkpoint", "step": step, "uri": uri, "metrics": dict(metrics),
                   "id": ident})
        deadline = time.monotonic() + self.ack_timeout_s
        while not ray.get(self.relay.is_acked.remote(ident), timeout=CALL_TIMEOUT_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver did not take the checkpoint of step {step} "
                                   f"within {self.ack_timeout_s:.0f} s")
            time.sleep(0.05)

    def should_stop(self) -> bool:
        stop, self.preempt = ray.get(self.relay.get_stop.remote(), timeout=CALL_TIMEOUT_S)
        return bool(stop)

    def preempted(self) -> bool:
        return self.preempt


class _Tee(io.TextIOBase):
    """A rank's stdout/stderr: written through, and each complete line sent to the relay."""

    def __init__(self, inner: TextIO, relay: Any, rank: int, stream: str) -> None:
        self.inner, self.relay, self.rank, self.stream = inner, relay, rank, stream
        self.buf = ""

    def write(self, text: str) -> int:
        self.inner.write(text)
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if line.strip():
                self.relay.put.remote({"kind": "output", "rank": self.rank,
                                       "stream": self.stream, "line": line[:MAX_LINE]})
        return len(text)

    def flush(self) -> None:
        self.inner.flush()


@ray.remote(max_restarts=0, max_task_retries=0)
class Rank:
    """One rank of the job, in its own Ray worker process on its bundle's node."""

    def __init__(self, rank: int, world: int, local_rank: int, local_world: int,
                 relay: Any) -> None:
        self.rank, self.world = rank, world
        self.local_rank, self.local_world = local_rank, local_world
        self.relay = relay

    def where(self) -> dict[str, Any]:
        """This rank's node (Ray node id, IP, host name) and pid, for placement reports."""
        import socket

        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid()}

    def endpoint(self) -> tuple[str, int]:
        """Rank 0's rendezvous address: this node's IP and a free port on it."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, spec_json: str, master: tuple[str, int], resume: bool, objective: Any,
            pinned: Any, env: dict[str, str], ack_timeout_s: float,
            rollout: tuple[Any, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Train this rank: the rendezvous variables, then the engine as under torchrun;
        ``rollout``: this rank's rollout actor and where it runs, when it has one."""
        os.environ.update(env)
        os.environ.update({
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world),
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        })
        from workers import threads

        threads.configure(self.local_world, role=f"rank {self.rank}")
        out, err = sys.stdout, sys.stderr
        sys.stdout = _Tee(out, self.relay, self.rank, "stdout")
        sys.stderr = _Tee(err, self.relay, self.rank, "stderr")
        try:
            from workers.rl.spec import parse_spec
            from workers.rl.trainer import train

            spec = parse_spec(json.loads(spec_json))
            sink = RelayReporter(self.relay, ack_timeout_s) if self.rank == 0 else None
            launcher = None
            if rollout is not None:
                cl = spec.cluster
                assert cl is not None
                launcher = RemoteRollouts(rollout[0], self.rank, rollout[1], cl.push_timeout_s,
                                          cl.bucket_mb * 1024 * 1024, cl.verify_pushes)
            try:
                result = train(spec, sink, resume=resume, objective=objective, pinned=pinned,
                               rollouts=launcher)
            except Stopped as exc:
                return {"rank": self.rank, "stopped": str(exc)}
            return {"rank": self.rank, "steps": result.steps,
                    "trained": sorted(result.train_time), "losses": result.losses,
                    "pushes": launcher.pushes() if launcher is not None else []}
        finally:
            sys.stdout.flush()
            sys.stdout, sys.stderr = out, err
            # Calls from one caller run in order: once this returns, every report and line
            # this rank sent has reached the relay. A lost relay must not hide the rank's own
            # outcome (the driver notices the relay itself).
            with contextlib.suppress(RayError):
                ray.get(self.relay.put.remote({"kind": "end", "rank": self.rank}),
                        timeout=CALL_TIMEOUT_S)


# -- the driver ---------------------------------------------------------------------------------

def connect(address: str | None = None) -> None:
    """Join the Ray cluster (``address``, else ``RAY_ADDRESS``, else the one this host runs)
    unless this process already has; a host with no cluster fails here, naming the fix."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise PlacementFailed(f"no Ray cluster at {address}: start one (`ray start --head` on "
                              f"the head node, `ray start --address=...` on the others) and "
                              f"set RAY_ADDRESS ({exc})") from exc


class _Forwarder:
    """Hands the relay's records to the caller's reporter, in order."""

    def __init__(self, relay: Any, reporter: Reporter) -> None:
        self.relay, self.reporter = relay, reporter
        self.next = 0
        self.dropped_seen = 0
        self.stopped: Stopped | None = None  # the reporter refused a report: the run is over
        self.start = 0
        self.ended: set[int] = set()
        self.stop_sent = (False, False)

    def pump(self) -> None:
        records, self.next, dropped = ray.get(self.relay.take.remote(self.next),
                                              timeout=CALL_TIMEOUT_S)
        for rec in records:
            self.forward(rec)
        if dropped > self.dropped_seen:
            self.call(self.reporter.event, "warning",
                      f"{dropped - self.dropped_seen} lines of rank output dropped "
                      "(the relay was full)", {"dropped": dropped})
            self.dropped_seen = dropped

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        if self.stopped is not None:
            return
        try:
            fn(*args)
        except Stopped as exc:  # a lost lease or a cancel: stop the ranks, report nothing more
            self.stopped = exc

    def forward(self, rec: dict[str, Any]) -> None:
        kind, rep = rec["kind"], self.reporter
        if kind == "log":
            self.call(rep.log, rec["step"], rec["metrics"])
        elif kind == "event":
            if rec["message"].startswith("resumed from"):
                self.start = int(rec["data"].get("step", 0))
            self.call(rep.event, rec["level"], rec["message"], rec["data"])
        elif kind == "samples":
            self.call(rep.samples, rec["step"], rec["rows"])
        elif kind == "checkpoint":
            try:
                self.call(rep.checkpoint, rec["step"], rec["uri"], rec["metrics"])
            finally:
                self.relay.ack.remote(rec["id"])
        elif kind == "output":
            self.call(rep.event, "info", f"rank {rec['rank']}: {rec['line']}",
                      {"rank": rec["rank"], "stream": rec["stream"]})
        elif kind == "end":
            self.ended.add(rec["rank"])

    def sync_stop(self) -> bool:
        """Tell rank 0 what the reporter says about stopping; True once a stop was asked."""
        if self.stopped is not None:
            want = (True, False)
        else:
            try:
                want = (self.reporter.should_stop(), self.reporter.preempted())
            except Stopped as exc:
                self.stopped, want = exc, (True, False)
        if want != self.stop_sent:
            ray.get(self.relay.set_stop.remote(*want), timeout=CALL_TIMEOUT_S)
            self.stop_sent = want
        return want[0]


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "not yet placed"
    return f"node {info['node_id'][:12]} at {info['ip']}, pid {info['pid']}"


def _failure(rank: int, info: dict[str, Any] | None, exc: BaseException) -> RankFailed:
    """The attempt's failure from what ``ray.get`` raised for ``rank``."""
    where = _describe(info)
    if isinstance(exc, RayActorError):
        return RankFailed(rank, where, "its process or node is gone (killed, out of memory, or "
                          f"the node left the cluster): {str(exc).splitlines()[0][:300]}",
                          died=True)
    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        tail = "".join(str(exc).splitlines(keepends=True)[-6:]).strip()
        return RankFailed(rank, where, f"{type(cause).__name__}: {cause}\n{tail}"[:4000],
                          died=False, cause=cause)
    return RankFailed(rank, where, f"{type(exc).__name__}: {exc}", died=False, cause=exc)


def run_on_ray(spec: Any, reporter: Reporter, plan: ClusterPlan, *, resume: bool = False,
               objective: Any = None, pinned: Any = None, poll_s: float = 0.2) -> JobResult:
    """Run one attempt of ``spec`` (a ``workers.rl.spec.RunSpec``) as a Ray job on the plan's
    nodes, reporting through ``reporter`` from this process. Returns when every rank has
    finished; raises :class:`RankFailed`, :class:`PlacementFailed`, ``Stopped`` (a cancel,
    a lost lease or a preemption, after the ranks stopped) or ``IncompleteRun``."""
    connect()
    n_rollouts = _rollout_actors(spec, plan)
    pg = placement_group(plan.bundles(), strategy="STRICT_SPREAD")
    rollout_pg: PlacementGroup | None = None
    actors: list[Any] = []
    rollouts: list[Any] = []
    relay: Any = None
    try:
        try:
            ray.get(pg.ready(), timeout=plan.placement_timeout_s)
        except GetTimeoutError as exc:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            raise PlacementFailed(
                f"Ray could not place {plan.nodes} node bundles {plan.bundles()[0]} "
                f"(STRICT_SPREAD) within {plan.placement_timeout_s:.0f} s; the cluster has "
                f"{len(alive)} live node(s)"
                + (f"; the allocation's nodes {list(plan.node_names)} must each run a Ray "
                   "node offering its crucible-node-<name> resource" if plan.node_names else "")
            ) from exc
        if n_rollouts:  # after the ranks' group: the ranks' nodes are taken first
            rollout_pg = _place_rollouts(spec.cluster, n_rollouts, plan)
        here = ray.get_runtime_context().get_node_id()
        # On the driver's node: it lives exactly as long as the driver can use it.
        relay = Relay.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        actors = _start_ranks(pg, plan, relay)
        placement = ray.get([a.where.remote() for a in actors], timeout=plan.placement_timeout_s)
        if rollout_pg is not None:
            rollouts = _start_rollouts(rollout_pg, spec.cluster, n_rollouts, plan)
        rollout_places = ray.get([r.where.remote() for r in rollouts],
                                 timeout=plan.placement_timeout_s)
        reporter.event("info", f"multi-node attempt on {plan.nodes} node(s), {plan.world} "
                       "rank(s): " + "; ".join(f"rank {p['rank']} on {_describe(p)}"
                                                 for p in placement)
                       + "".join(f"; rollout actor {p['rollout_actor']} on {describe(p)}"
                                 for p in rollout_places),
                       {"placement": placement, "nodes": plan.nodes, "world_size": plan.world,
                        "driver_node_id": here, "rollouts": rollout_places})
        master = ray.get(actors[0].endpoint.remote(), timeout=CALL_TIMEOUT_S)
        # A rank computes with the cores Ray reserved for it, not the node's.
        env = {"CRUCIBLE_DIST_TIMEOUT_S": str(plan.collective_timeout_s),
               "CRUCIBLE_THREADS": str(max(1, int(plan.cpus_per_rank))), **plan.env}
        if not plan.gpus_per_node:
            env.setdefault("CRUCIBLE_DEVICE", "cpu")
        refs = {a.run.remote(spec.to_json(), master, resume, objective, pinned, env,
                             plan.report_timeout_s,
                             (rollouts[r], rollout_places[r]) if rollouts else None): r
                for r, a in enumerate(actors)}
        watch = {r.serve.remote(): i for i, r in enumerate(rollouts)}
        outcome = _drive(refs, placement, relay, reporter, plan, poll_s,
                         watch=watch, rollout_places=rollout_places)
        return _finish(spec, outcome, placement, rollout_places)
    finally:
        for a in [*actors, *rollouts]:
            ray.kill(a, no_restart=True)
        if relay is not None:
            ray.kill(relay, no_restart=True)
        remove_placement_group(pg)
        if rollout_pg is not None:
            remove_placement_group(rollout_pg)


def _rollout_actors(spec: Any, plan: ClusterPlan) -> int:
    """How many rollout actors the run asks for: none, or one per learner rank."""
    n = spec.cluster.rollout_actors if spec.cluster is not None else 0
    if n and n != plan.world:
        raise ValueError(f"cluster.rollout_actors = {n}: each learner rank samples through "
                         f"one rollout actor of its own, so give the number of ranks "
                         f"({plan.world}) or 0")
    if n and spec.rollout.backend == "vllm" and not spec.cluster.rollout_gpus:
        raise ValueError("rollout.backend = 'vllm' on rollout actors needs a GPU each: set "
                         "cluster.rollout_gpus = 1")
    return int(n)


def _place_rollouts(cl: Any, n: int, plan: ClusterPlan) -> PlacementGroup:
    """The rollout actors' own placement group: one bundle each."""
    bundle: dict[str, float] = {"CPU": cl.rollout_cpus}
    if cl.rollout_gpus:
        bundle["GPU"] = cl.rollout_gpus
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=cl.rollout_placement)
    try:
        ray.get(pg.ready(), timeout=plan.placement_timeout_s)
    except GetTimeoutError as exc:
        remove_placement_group(pg)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        raise PlacementFailed(
            f"Ray could not place {n} rollout actor bundles {bundle} ({cl.rollout_placement}) "
            f"next to the ranks within {plan.placement_timeout_s:.0f} s; the cluster has "
            f"{len(alive)} live node(s)") from exc
    return pg


def _start_rollouts(pg: PlacementGroup, cl: Any, n: int, plan: ClusterPlan) -> list[Any]:
    """One rollout actor per bundle; threaded, so pushes arrive while it samples."""
    env = {"CRUCIBLE_THREADS": str(max(1, int(cl.rollout_cpus))), **plan.env}
    if not cl.rollout_gpus:
        env.setdefault("CRUCIBLE_DEVICE", "cpu")
    return [RolloutActor.options(  # type: ignore[attr-defined]
        num_cpus=cl.rollout_cpus, num_gpus=cl.rollout_gpus, max_concurrency=8,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
    ).remote(i, env) for i in range(n)]


def _start_ranks(pg: PlacementGroup, plan: ClusterPlan, relay: Any) -> list[Any]:
    """One actor per rank on its node's bundle, in rank order."""
    actors = []
    for node in range(plan.nodes):
        for local in range(plan.ranks_per_node):
            rank = node * plan.ranks_per_node + local
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=node)
            actors.append(Rank.options(  # type: ignore[attr-defined]
                num_cpus=plan.cpus_per_rank, num_gpus=1 if plan.gpus_per_node else 0,
                scheduling_strategy=strategy,
            ).remote(rank, plan.world, 0 if plan.gpus_per_node else local,
                     plan.ranks_per_node, relay))
    return actors


@dataclass
class _Outcome:
    results: dict[int, dict[str, Any]]
    start: int
    stopped: str | None


def _drive(refs: dict[Any, int], placement: list[dict[str, Any]], relay: Any,
           reporter: Reporter, plan: ClusterPlan, poll_s: float,
           watch: dict[Any, int] | None = None,
           rollout_places: list[dict[str, Any]] | None = None) -> _Outcome:
    """Forward reports and the stop until every rank has returned; fail at the first rank
    or rollout actor (``watch``: each actor's ``serve`` call) that raised or died, naming it
    (one that died beats a rank that only lost its peer, and a lost actor beats its rank)."""
    fwd = _Forwarder(relay, reporter)
    pending = dict(refs)
    watching = dict(watch or {})
    results: dict[int, dict[str, Any]] = {}
    failures: dict[int, RankFailed] = {}
    lost: list[RolloutFailed] = []
    stop_deadline: float | None = None
    first_failure: float | None = None
    relay_error: RayError | None = None
    while pending:
        ready, _ = ray.wait([*pending, *watching], num_returns=len(pending) + len(watching),
                            timeout=poll_s)
        for ref in ready:
            if ref in watching:
                index = watching.pop(ref)
                try:
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                except RayError as exc:
                    where = describe((rollout_places or [])[index])
                    lost.append(RolloutFailed(
                        index, where, "its process or node is gone (killed, out of memory, "
                        f"or the node left the cluster): {str(exc).splitlines()[0][:300]}",
                        died=True))
                    first_failure = first_failure or time.monotonic()
                continue
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except RayError as exc:
                failures[rank] = _failure(rank, placement[rank], exc)
                first_failure = first_failure or time.monotonic()
        if relay_error is None:
            try:
                fwd.pump()
            except ActorUnavailableError:
                pass  # a transient loss of contact: try again at the next turn
            except RayError as exc:
                # Rank 0 cannot report any more and fails at its next report; wait for the
                # ranks, so the failure names the rank whose loss took the relay with it.
                relay_error = exc
                first_failure = first_failure or time.monotonic()
        if first_failure is not None and (
                not pending or time.monotonic() - first_failure > plan.failure_grace_s):
            break
        if relay_error is not None:
            continue
        if not failures and fwd.sync_stop() and stop_deadline is None:
            stop_deadline = time.monotonic() + plan.stop_grace_s
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            raise RankFailed(min(pending.values()), _describe(placement[min(pending.values())]),
                             f"did not stop within {plan.stop_grace_s:.0f} s of the stop",
                             died=False, cause=TimeoutError("stop"))
    died = [r for r in sorted(failures) if failures[r].died]
    if died:
        raise failures[died[0]]
    if lost:
        raise lost[0]
    if failures:
        raise failures[min(failures)]
    if relay_error is not None:
        raise RankFailed(0, "the report relay", f"the relay between rank 0 and this worker "
                         f"died: {str(relay_error).splitlines()[0][:300]}", died=True)
    # Every rank sent its last record before returning; take what is still in the relay.
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while len(fwd.ended) < len(refs) and time.monotonic() < deadline:
        fwd.pump()
        time.sleep(0.02)
    if fwd.stopped is not None:
        raise fwd.stopped
    stopped = next((r["stopped"] for r in results.values() if "stopped" in r), None)
    return _Outcome(results, fwd.start, stopped)


def _finish(spec: Any, outcome: _Outcome, placement: list[dict[str, Any]],
            rollouts: list[dict[str, Any]]) -> JobResult:
    if outcome.stopped is not None:
        raise Stopped(outcome.stopped)
    r0 = outcome.results[0]
    total = spec.trainer.steps
    trained = check_trained(outcome.start, total, r0["trained"])
    return JobResult(start=outcome.start, steps=r0["steps"], trained=trained,
                     losses={int(k): float(v) for k, v in r0["losses"].items()},
                     placement=placement, rollouts=rollouts,
                     pushes={r: res["pushes"] for r, res in outcome.results.items()
                             if res.get("pushes")})


def run_with_retries(spec: Any, reporter: Reporter, plan: Callable[[int], ClusterPlan], *,
                     max_attempts: int = 3, objective: Any = None,
                     pinned: Any = None) -> tuple[list[str], JobResult]:
    """Attempts of one run until one succeeds: an attempt lost to a dead rank or node is
    retried from the newest checkpoint in ``spec.checkpoint.dir`` on whatever nodes the cluster
    can place (``plan(attempt)``); a final failure is raised. Returns the attempts' outcomes
    (``lost`` / ``succeeded``) and the last result. The platform does this through its own
    retries instead (the worker reports a retryable failure; the next claim resumes)."""
    from workers.rl import checkpoint as ckpt

    outcomes: list[str] = []
    for attempt in range(1, max_attempts + 1):
        resume = ckpt.latest(spec.checkpoint.folder) is not None
        try:
            result = run_on_ray(spec, reporter, plan(attempt), resume=resume,
                                objective=objective, pinned=pinned)
        except (RankFailed, RolloutFailed, PlacementFailed) as exc:
            if not exc.retryable or attempt == max_attempts:
                raise
            reporter.event("warning", f"attempt {attempt} lost: {exc}",
                           {"attempt": attempt, "rank": getattr(exc, "rank", None),
                            "rollout_actor": getattr(exc, "index", None)})
            outcomes.append("lost")
            continue
        outcomes.append("succeeded")
        return outcomes, result
    raise AssertionError("unreachable")
