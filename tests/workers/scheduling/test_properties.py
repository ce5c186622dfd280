"""Invariants of `decide()` over random snapshots (hypothesis).

Each example builds a random cluster, lets one pass fill it from an empty start (so the
snapshot the second pass sees is one the engine itself produced), marks those runs as running,
adds new arrivals of every class, advances the clock and runs a second pass. The checks below are
written independently of the engine's own books.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.scheduling import (
    DEFAULT_PRIORITY_CLASSES,
    ClusterState,
    Node,
    NodeState,
    Policy,
    QueueSpec,
    Resources,
    Workload,
    WorkloadStatus,
    decide,
)
from workers.scheduling.actions import Action, Admit, Preempt, Wait

FLAVORS = ("H100", "A100")
CLASSES = {c.name: c for c in DEFAULT_PRIORITY_CLASSES}
POLICY = Policy()


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    nodes = []
    for i in range(rng.randint(1, 6)):
        state = rng.choice([NodeState.READY] * 4 + [NodeState.CORDONED, NodeState.LOST])
        nodes.append(Node(name=f"n{i}", flavor=rng.choice(FLAVORS),
                          gpu_ids=tuple(range(rng.choice([1, 2, 4, 8]))), cpus=rng.choice([4, 16]),
                          memory_gb=64, state=state))
    queues = []
    for i in range(rng.randint(1, 4)):
        cohort = rng.choice([None, "c1", "c1", "c2"])
        nominal = {f: float(rng.choice([0, 2, 4, 8, 16])) for f in FLAVORS}
        borrow = {f: float(rng.choice([0, 2, 8])) for f in FLAVORS} if cohort and \
            rng.random() < 0.5 else None
        lend = {f: float(rng.randint(0, int(nominal[f]))) for f in FLAVORS} if cohort and \
            rng.random() < 0.5 else None
        queues.append(QueueSpec(name=f"q{i}", cohort=cohort, nominal=nominal,
                                borrowing_limit=borrow, lending_limit=lend))
    first = [_job(rng, i, queues, 0.0) for i in range(rng.randint(0, 25))]
    snap = ClusterState(nodes=tuple(nodes), queues=tuple(queues), workloads=tuple(first), now=0)
    held = _apply(snap, decide(snap, POLICY), started=True)
    later = [_job(rng, 100 + i, queues, rng.uniform(0, 5000), urgent=0.5)
             for i in range(rng.randint(0, 25))]
    # Some runs must avoid some nodes (their sandbox probe fails a language the run needs).
    later = [replace(w, avoid=frozenset(n.name for n in nodes if rng.random() < 0.3))
             if rng.random() < 0.3 else w for w in later]
    now = rng.choice([300.0, 5000.0, 5000.0, 50_000.0])
    held = [replace(w, last_checkpoint_at=rng.choice([None, rng.uniform(max(0, now - 1800), now),
                                                      rng.uniform(max(0, now - 600), now)]),
                    preemptions=rng.choice([0, 0, 1, 3])) for w in held]
    return ClusterState(nodes=tuple(nodes), queues=tuple(queues), workloads=tuple(held + later),
                        now=now)


def _job(rng: random.Random, i: int, queues: list[QueueSpec], at: float,
         urgent: float = 0.0) -> Workload:
    """A random request; `urgent` is the extra chance that it is production work."""
    gpus = rng.choice([0, 1, 1, 2, 4, 8])
    types = tuple(rng.sample(FLAVORS, rng.randint(0, 2))) if gpus else ()
    res = Resources(gpus_per_node=gpus, nodes=rng.choice([1, 1, 1, 2, 3]), gpu_types=types,
                    cpus=rng.choice([1, 2, 4]), memory_gb=rng.choice([1, 16]),
                    max_runtime_s=rng.choice([None, 60.0, 3600.0, 86_400.0]))
    return Workload(id=f"w{i:03d}", queue=rng.choice(queues).name, submitted_at=at,
                    priority="production" if rng.random() < urgent else rng.choice(list(CLASSES)),
                    resources=res)


def _apply(state: ClusterState, actions: list[Action], *, started: bool) -> list[Workload]:
    """The workloads after the actions: admitted ones hold, preempted ones are gone."""
    by_id = {w.id: w for w in state.workloads}
    out = {w.id: w for w in state.workloads if w.status != WorkloadStatus.PENDING}
    for a in actions:
        if isinstance(a, Preempt):
            out.pop(a.workload_id)
        elif isinstance(a, Admit):
            status = WorkloadStatus.RUNNING if started else WorkloadStatus.ADMITTED
            out[a.workload_id] = replace(by_id[a.workload_id], status=status,
                                         allocation=dict(a.allocation),
                                         started_at=state.now if started else None)
    return list(out.values())


def _flavor(nodes: Mapping[str, Node], w: Workload) -> str:
    return nodes[next(iter(w.allocation))].flavor


def check_capacity(state: ClusterState, holders: list[Workload]) -> None:
    nodes = {n.name: n for n in state.nodes}
    gpus: dict[str, list[int]] = {n: [] for n in nodes}
    cpus = dict.fromkeys(nodes, 0.0)
    mem = dict.fromkeys(nodes, 0.0)
    for w in holders:
        for name, ids in w.allocation.items():
            gpus[name].extend(ids)
            cpus[name] += w.resources.cpus
            mem[name] += w.resources.memory_gb
    for name, node in nodes.items():
        assert len(gpus[name]) == len(set(gpus[name])), f"a GPU of {name} is given twice"
        assert set(gpus[name]) <= set(node.gpu_ids)
        assert cpus[name] <= node.cpus and mem[name] <= node.memory_gb


def check_quotas(state: ClusterState, holders: list[Workload]) -> None:
    nodes = {n.name: n for n in state.nodes}
    queues = {q.name: q for q in state.queues}
    use: dict[tuple[str, str], float] = {}
    fixed: dict[tuple[str, str], float] = {}
    for w in holders:
        key = (w.queue, _flavor(nodes, w))
        use[key] = use.get(key, 0.0) + w.resources.quota_amount()
        if not CLASSES[w.priority].preemptible:
            fixed[key] = fixed.get(key, 0.0) + w.resources.quota_amount()
    for (q_name, f), amount in fixed.items():
        assert amount <= queues[q_name].nominal.get(f, 0.0), "unpreemptible use over nominal"
    lent: dict[tuple[str, str], float] = {}
    pool: dict[tuple[str, str], float] = {}
    for q in queues.values():
        for f in set(FLAVORS) | {"cpu"}:
            u, n = use.get((q.name, f), 0.0), q.nominal.get(f, 0.0)
            limit = (q.borrowing_limit or {}).get(f, float("inf")) if q.cohort else 0.0
            assert u <= n + limit, f"{q.name}/{f} uses {u} > {n} + {limit}"
            if q.cohort:
                lendable = (q.lending_limit or {}).get(f, n)
                pool[(q.cohort, f)] = pool.get((q.cohort, f), 0.0) + lendable
                lent[(q.cohort, f)] = lent.get((q.cohort, f), 0.0) + max(0.0, u - (n - lendable))
    for key, amount in lent.items():
        assert amount <= pool[key], f"cohort {key} lends {amount} > {pool[key]}"


def check_admits(state: ClusterState, actions: list[Action]) -> None:
    nodes = {n.name: n for n in state.nodes}
    by_id = {w.id: w for w in state.workloads}
    for a in actions:
        if not isinstance(a, Admit):
            continue
        res = by_id[a.workload_id].resources
        assert len(a.allocation) == res.nodes, "a gang is placed whole or not at all"
        assert {nodes[n].flavor for n in a.allocation} == {a.flavor}
        for name, ids in a.allocation.items():
            assert nodes[name].state == NodeState.READY
            assert name not in by_id[a.workload_id].avoid, "never on a node it avoids"
            assert len(ids) == res.gpus_per_node
        if res.gpu_types:
            assert a.flavor in res.gpu_types


def check_preemptions(state: ClusterState, actions: list[Action]) -> None:
    by_id = {w.id: w for w in state.workloads}
    admitted = {a.workload_id for a in actions if isinstance(a, Admit)}
    for a in actions:
        if isinstance(a, Preempt):
            assert a.for_workload in admitted, "a preemption comes with its admission"
            v = by_id[a.workload_id]
            assert v.status == WorkloadStatus.RUNNING and CLASSES[v.priority].preemptible
            assert v.started_at is not None
            assert state.now - v.started_at >= POLICY.min_runtime_s
            assert v.preemptions < POLICY.max_preemptions
            since = max(v.started_at, v.last_checkpoint_at or v.started_at)
            assert POLICY.max_victim_loss_s is not None
            assert state.now - since <= POLICY.max_victim_loss_s, "lost work above the limit"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_a_pass_keeps_every_invariant(state: ClusterState) -> None:
    actions = decide(state, POLICY)
    holders = _apply(state, actions, started=False)
    check_capacity(state, holders)
    check_quotas(state, holders)
    check_admits(state, actions)
    check_preemptions(state, actions)
    pending = [w.id for w in state.workloads if w.status == WorkloadStatus.PENDING]
    answered = [a.workload_id for a in actions if isinstance(a, Admit | Wait)]
    assert sorted(answered) == sorted(pending), "each pending run is admitted or told why not"


@settings(max_examples=100, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_decide_is_deterministic_whatever_the_input_order(state: ClusterState,
                                                          rng: random.Random) -> None:
    shuffled = list(state.workloads)
    rng.shuffle(shuffled)
    nodes = list(state.nodes)
    rng.shuffle(nodes)
    again = replace(state, workloads=tuple(shuffled), nodes=tuple(nodes))
    assert decide(state) == decide(state) == decide(again)
