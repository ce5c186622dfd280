"""The working books of one admission pass: free GPUs, CPUs and memory per node, and quota use
per queue and cohort. `decide()` and the baseline take from and give back to these as they
plan; the snapshot itself is never changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from workers.scheduling.spec import CPU_FLAVOR, QueueSpec, Resources
from workers.scheduling.state import ClusterState, Node, NodeState, Workload

Allocation = dict[str, tuple[int, ...]]


@dataclass(slots=True)
class Reservation:
    """Resources promised to a waiting run from time `start`: GPU ids and CPU cores per node.
    A run that would still hold any of them at `start` may not take them now."""

    workload_id: str
    start: float
    gpus: dict[str, frozenset[int]]
    cpus: dict[str, float]


def flavor_of(workload: Workload, nodes: Mapping[str, Node]) -> str:
    """The flavor a holding workload is counted on: that of its (first) node."""
    if workload.resources.gpus_per_node == 0:
        return CPU_FLAVOR
    for name in workload.allocation:
        node = nodes.get(name)
        if node is not None:
            return node.flavor
    return CPU_FLAVOR


@dataclass
class Capacity:
    """Free resources per node, and the ready nodes of each flavor in name order."""

    nodes: dict[str, Node]
    free_gpus: dict[str, list[int]]
    free_cpus: dict[str, float]
    free_mem: dict[str, float]
    ready: dict[str, list[Node]] = field(default_factory=dict)
    free_total: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, state: ClusterState, holders: Iterable[Workload]) -> Capacity:
        """Free resources once every holder's allocation is taken (in one sweep)."""
        nodes = {n.name: n for n in sorted(state.nodes, key=lambda n: n.name)}
        used: dict[str, set[int]] = {name: set() for name in nodes}
        cpus = {n.name: n.cpus for n in nodes.values()}
        mem = {n.name: n.memory_gb for n in nodes.values()}
        for w in holders:
            for name, ids in w.allocation.items():
                if name in nodes:
                    used[name].update(ids)
                    cpus[name] -= w.resources.cpus
                    mem[name] -= w.resources.memory_gb
        cap = cls(nodes=nodes, free_cpus=cpus, free_mem=mem,
                  free_gpus={name: [g for g in n.gpu_ids if g not in used[name]]
                             for name, n in nodes.items()})
        for node in nodes.values():
            cap.free_gpus[node.name].sort()
            if node.state == NodeState.READY:
                cap.ready.setdefault(node.flavor, []).append(node)
                total = cap.free_total.get(node.flavor, 0.0) + cap._amount(node.name)
                cap.free_total[node.flavor] = total
        return cap

    def _amount(self, name: str) -> float:
        node = self.nodes[name]
        return len(self.free_gpus[name]) if node.flavor != CPU_FLAVOR else self.free_cpus[name]

    def take(self, res: Resources, allocation: Mapping[str, tuple[int, ...]]) -> None:
        for name, ids in allocation.items():
            if name not in self.nodes:
                continue
            before = self._amount(name)
            taken = set(ids)
            self.free_gpus[name] = [g for g in self.free_gpus[name] if g not in taken]
            self.free_cpus[name] -= res.cpus
            self.free_mem[name] -= res.memory_gb
            self._count(name, self._amount(name) - before)

    def give(self, res: Resources, allocation: Mapping[str, tuple[int, ...]]) -> None:
        for name, ids in allocation.items():
            if name not in self.nodes:
                continue
            before = self._amount(name)
            self.free_gpus[name] = sorted(self.free_gpus[name] + list(ids))
            self.free_cpus[name] += res.cpus
            self.free_mem[name] += res.memory_gb
            self._count(name, self._amount(name) - before)

    def _count(self, name: str, delta: float) -> None:
        node = self.nodes[name]
        if node.state == NodeState.READY:
            self.free_total[node.flavor] = self.free_total.get(node.flavor, 0.0) + delta

    def usable_gpus(self, name: str, reservations: Iterable[Reservation]) -> list[int]:
        """Free GPU ids of a node that no given reservation claims."""
        free = self.free_gpus[name]
        for r in reservations:
            claimed = r.gpus.get(name)
            if claimed:
                free = [g for g in free if g not in claimed]
        return free

    def node_fits(self, name: str, res: Resources, reservations: list[Reservation],
                  avoid: frozenset[str] = frozenset()) -> bool:
        if name in avoid:
            return False
        cpus = self.free_cpus[name] - sum(r.cpus.get(name, 0.0) for r in reservations)
        if cpus < res.cpus or self.free_mem[name] < res.memory_gb:
            return False
        if res.gpus_per_node == 0:
            return True
        return len(self.usable_gpus(name, reservations)) >= res.gpus_per_node

    def place(self, res: Resources, flavor: str, reservations: list[Reservation],
              avoid: frozenset[str] = frozenset()) -> tuple[Allocation | None, int]:
        """Best fit of a whole gang on ready nodes of `flavor`, avoiding reserved resources.

        Nodes are ranked by how little would be left on them (tightest first, then name), so
        small runs fill partly used nodes and whole nodes stay whole for gangs; GPU ids are the
        lowest free ones; nodes in `avoid` are skipped. Returns the allocation, or None and
        how many nodes did fit (-1: not counted, the flavor lacks the total).
        """
        need = res.gpus_per_node if res.gpus_per_node else res.cpus
        if self.free_total.get(flavor, 0.0) < need * res.nodes:
            return None, -1
        fitting: list[tuple[float, str]] = []
        for node in self.ready.get(flavor, ()):
            if self.node_fits(node.name, res, reservations, avoid):
                fitting.append((self._amount(node.name) - need, node.name))
        if len(fitting) < res.nodes:
            return None, len(fitting)
        fitting.sort()
        alloc: Allocation = {}
        for _, name in fitting[: res.nodes]:
            ids = self.usable_gpus(name, reservations)[: res.gpus_per_node]
            alloc[name] = tuple(ids)
        return alloc, res.nodes


    def count_fitting(self, res: Resources, flavor: str,
                      avoid: frozenset[str] = frozenset()) -> int:
        return sum(self.node_fits(n.name, res, [], avoid) for n in self.ready.get(flavor, ()))


@dataclass
class Quotas:
    """Quota use per queue and flavor, and the pooled (lent) use of each cohort.

    A queue's `guaranteed` part of a flavor is nominal minus lending limit: nobody else may use
    it. A cohort's shared pool on a flavor is the sum of its queues' lendable parts; a queue's use
    above its guaranteed part is drawn from that pool. Admission keeps, for every queue and
    flavor, use <= nominal + borrowing limit, and for every cohort, pooled use <= pool.
    """

    queues: dict[str, QueueSpec]
    usage: dict[str, dict[str, float]]
    pooled: dict[tuple[str, str], float]
    pool: dict[tuple[str, str], float]
    guaranteed: dict[tuple[str, str], float] = field(default_factory=dict)
    fixed: dict[tuple[str, str], float] = field(default_factory=dict)  # non-preemptible use

    @classmethod
    def of(cls, state: ClusterState, holders: Iterable[Workload],
           nodes: Mapping[str, Node]) -> Quotas:
        queues = {q.name: q for q in state.queues}
        pool: dict[tuple[str, str], float] = {}
        for q in queues.values():
            if q.cohort is not None:
                for flavor in q.nominal:
                    key = (q.cohort, flavor)
                    pool[key] = pool.get(key, 0.0) + q.lendable(flavor)
        books = cls(queues=queues, usage={q: {} for q in queues}, pooled={}, pool=pool)
        preemptible = {c.name: c.preemptible for c in state.priority_classes}
        totals: dict[tuple[str, str, bool], float] = {}
        for w in holders:
            if w.queue in queues:
                fixed = not preemptible.get(w.priority,
                                            preemptible.get(queues[w.queue].default_priority, True))
                slot = (w.queue, flavor_of(w, nodes), fixed)
                totals[slot] = totals.get(slot, 0.0) + w.resources.amount
        for (queue, flavor, fixed), amount in sorted(totals.items()):
            books.add(queue, flavor, amount, fixed=fixed)
        return books

    def used(self, queue: str, flavor: str) -> float:
        return self.usage[queue].get(flavor, 0.0)

    def nominal(self, queue: str, flavor: str) -> float:
        return self.queues[queue].nominal.get(flavor, 0.0)

    def _guaranteed(self, q: QueueSpec, flavor: str) -> float:
        key = (q.name, flavor)
        value = self.guaranteed.get(key)
        if value is None:
            value = self.guaranteed[key] = q.nominal.get(flavor, 0.0) - q.lendable(flavor)
        return value

    def _draw(self, q: QueueSpec, flavor: str, use: float) -> float:
        return max(0.0, use - self._guaranteed(q, flavor))

    def add(self, queue: str, flavor: str, amount: float, *, fixed: bool = False) -> None:
        """Count `amount` (negative: give back); `fixed` marks a run that cannot be preempted."""
        q = self.queues[queue]
        if fixed:
            self.fixed[(queue, flavor)] = self.fixed.get((queue, flavor), 0.0) + amount
        before = self.used(queue, flavor)
        self.usage[queue][flavor] = before + amount
        if q.cohort is not None:
            key = (q.cohort, flavor)
            delta = self._draw(q, flavor, before + amount) - self._draw(q, flavor, before)
            self.pooled[key] = self.pooled.get(key, 0.0) + delta

    def fits(self, queue: str, flavor: str, amount: float, *, fixed: bool = False) -> bool:
        """Would `amount` more on `flavor` stay within the queue's and its cohort's limits?

        A run that cannot be preempted (`fixed`) must also keep the queue's non-preemptible use
        within nominal: whatever a queue borrows is then always preemptible, so a lender can
        always reclaim it.
        """
        q = self.queues[queue]
        after = self.used(queue, flavor) + amount
        nominal = q.nominal.get(flavor, 0.0)
        if fixed and self.fixed.get((queue, flavor), 0.0) + amount > nominal + 1e-9:
            return False
        if after > nominal + q.borrow_cap(flavor) + 1e-9:
            return False
        if q.cohort is None:
            return True
        key = (q.cohort, flavor)
        delta = self._draw(q, flavor, after) - self._draw(q, flavor, after - amount)
        return self.pooled.get(key, 0.0) + delta <= self.pool.get(key, 0.0) + 1e-9

    def borrowing(self, queue: str, flavor: str) -> bool:
        return self.used(queue, flavor) > self.nominal(queue, flavor) + 1e-9

    def share(self, queue: str) -> float:
        """Dominant share of what a queue borrows: the largest, over flavors, of its use above
        nominal over its cohort's pool of that flavor (0 for a queue within nominal)."""
        q = self.queues[queue]
        if q.cohort is None:
            return 0.0
        best = 0.0
        for flavor, use in self.usage[queue].items():
            over = use - q.nominal.get(flavor, 0.0)
            if over > 0:
                best = max(best, over / max(self.pool.get((q.cohort, flavor), 0.0), 1.0))
        return best

    def violations(self) -> list[str]:
        """Every limit the current use breaks (for invariant checks and the benchmark)."""
        out = []
        for name, q in self.queues.items():
            for flavor, use in self.usage[name].items():
                ceiling = q.nominal.get(flavor, 0.0) + q.borrow_cap(flavor)
                if use > ceiling + 1e-9:
                    out.append(f"{name}/{flavor}: {use} > nominal+borrowing {ceiling}")
        for (cohort, flavor), use in self.pooled.items():
            if use > self.pool.get((cohort, flavor), 0.0) + 1e-9:
                out.append(f"cohort {cohort}/{flavor}: lent {use} > lendable "
                           f"{self.pool.get((cohort, flavor), 0.0)}")
        return out
