"""The admission policy: `decide(state) -> actions`, pure and deterministic.

One pass reads a frozen `ClusterState` and returns what to do now. Its rules, in order:

1. **Order.** Pending runs are taken highest priority class first. Within a class, a run its
   queue can start within nominal quota goes before one that would borrow; among borrowers the
   queue with the smallest dominant share of borrowed quota goes first (fair sharing); then the
   earlier submission, then the id. Each queue keeps its own order; the pass merges the queues'
   heads, so every pending run is looked at and many are admitted in one pass.
2. **Quota** (`ledger.Quotas`): use <= nominal + borrowing limit per queue and flavor; what a
   queue uses above its guaranteed part (nominal minus lending limit) comes from its cohort's
   pool of lendable quota, which must not run dry. Runs that cannot be preempted keep their
   queue's non-preemptible use within nominal, so what a queue borrows is always reclaimable.
   A run within nominal that is short only because its quota is lent out stops its queue's
   later runs and every borrower in the cohort from taking more of that flavor until it is
   back, so borrowers cannot starve it; a run blocked by its own queue's use that could fit
   within nominal does the same to its own queue once it has waited `starvation_guard_s`.
3. **Placement** (`ledger.Capacity.place`): a gang goes whole onto ready nodes of one flavor,
   best fit (tightest nodes first) so whole nodes stay whole; nodes not `ready` get no new work.
4. **Backfill with reservations** (EASY): the first run of a queue that fits its quota but not
   the nodes gets a reservation: the earliest time, replaying the holders' expected ends, at
   which specific GPUs become free for it. A later run may take reserved GPUs only if its
   `max_runtime_s` (or estimate) ends before that time; so backfill never delays a reserved run.
5. **Preemption by checkpoint**: a run that still does not fit may stop others, only if that
   makes it fit (the pass simulates it) and only victims that are preemptible, ran at least
   `min_runtime_s`, were preempted fewer than `max_preemptions` times, would lose at most
   `max_victim_loss_s` of work since their last checkpoint, and are either of lower
   priority in the same queue, or belong to a queue of the cohort that borrows and are of lower
   priority or the preemptor is reclaiming its own nominal quota. Victims are taken borrowed
   first, then lowest priority, then least work lost since their last checkpoint; victims that
   turn out not to be needed are kept. Every Preempt comes with the Admit it makes room for.
6. Everything else waits, with its reason, position in its queue and, if it holds a
   reservation, its expected start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from workers.scheduling.actions import (
    GANG_INCOMPLETE,
    NO_FITTING_NODES,
    QUOTA,
    Action,
    Admit,
    Preempt,
    Wait,
    behind,
)
from workers.scheduling.ledger import Allocation, Capacity, Quotas, Reservation, flavor_of
from workers.scheduling.spec import CPU_FLAVOR, PriorityClass
from workers.scheduling.state import ClusterState, Workload, WorkloadStatus

__all__ = ["Policy", "decide"]


@dataclass(frozen=True, slots=True)
class Policy:
    """The knobs of the policy. Defaults suit runs of minutes to days."""

    min_runtime_s: float = 600.0          # a run is not preempted before it ran this long
    max_preemptions: int = 3              # nor once it was preempted this many times
    max_victim_loss_s: float | None = 900.0  # nor while it would lose more work than this
    preemption: bool = True
    backfill: bool = True                 # False: a blocked run holds its flavor (strict FIFO)
    max_reservations: int = 8             # per pass, at most one per queue
    max_preemption_attempts: int = 8      # per pass; each simulates the placement
    assumed_runtime_s: float = 86_400.0   # for a holder with no estimate, when planning
    starvation_guard_s: float = 21_600.0  # a run blocked on its own queue's use this long
                                          # keeps the queue's later runs off its flavor
    scan_limit: int = 5_000               # runs looked at per pass; the rest wait "behind"


def decide(state: ClusterState, policy: Policy = Policy()) -> list[Action]:  # noqa: B008
    """One admission pass: admissions (with preemptions) first, then a Wait per pending run."""
    return _Pass(state, policy).run()


_Key = tuple[int, int, float, float, str]
_UNKNOWN = PriorityClass(name="unknown", value=0)


class _Pass:
    """The working state of one pass; see the module docstring for the rules."""

    def __init__(self, state: ClusterState, policy: Policy) -> None:
        self.state, self.policy, self.now = state, policy, state.now
        self.classes: dict[str, PriorityClass] = {c.name: c for c in state.priority_classes}
        self.class_of: dict[str, PriorityClass] = {}
        self.flavor_names: dict[str, list[str]] = {}
        self.queues = {q.name: q for q in state.queues}
        holders = state.holders()
        self.cap = Capacity.of(state, holders)
        self.quotas = Quotas.of(state, holders, self.cap.nodes)
        self.holding: dict[str, Workload] = {w.id: w for w in holders}
        self.flavor: dict[str, str] = {w.id: flavor_of(w, self.cap.nodes) for w in holders}
        self.actions: list[Action] = []
        self.waiting: list[tuple[Workload, str, float | None]] = []
        self.reservations: list[Reservation] = []
        self.reserved_queues: set[str] = set()
        self.held: dict[str, set[str]] = {}       # queue -> flavors kept for its blocked head
        self.reclaiming: set[tuple[str, str]] = set()  # (cohort, flavor): no new borrowing
        self.blocked_flavors: set[str] = set()    # backfill off: flavors with a blocked run
        # Per shape (and nodes avoided): how many nodes fit when none of the flavor did.
        self.no_fit: dict[tuple[str, int, int, float, float, frozenset[str]], int] = {}
        self.no_preempt: set[tuple[str, int, str, int, int, frozenset[str]]] = set()
        self.attempts = 0
        self.victim_pool: dict[str, set[str]] = {}   # flavor -> ids of preemptible holders
        self.lowest_victim: int | None = None
        for w in holders:
            if self._preemptible(w):
                self.victim_pool.setdefault(self.flavor[w.id], set()).add(w.id)
                value = self._prio(w)
                if self.lowest_victim is None or value < self.lowest_victim:
                    self.lowest_victim = value

    # -- small lookups -------------------------------------------------------------------

    def _class(self, w: Workload) -> PriorityClass:
        """The run's class; an unknown name falls back to its queue's default."""
        found = self.class_of.get(w.id)
        if found is None:
            name = w.priority if w.priority in self.classes else \
                self.queues[w.queue].default_priority if w.queue in self.queues else ""
            found = self.class_of[w.id] = self.classes.get(name, _UNKNOWN)
        return found

    def _prio(self, w: Workload) -> int:
        return self._class(w).value

    def _flavors(self, w: Workload) -> list[str]:
        """Flavors `w` may run on: within-nominal ones first, each group in the order the run
        listed them (any-of), else in the queue's quota order, then by name."""
        names = self.flavor_names.get(w.id)
        if names is None:
            names = self.flavor_names[w.id] = self._flavor_names(w)
        if len(names) == 1:
            return names
        amount = w.resources.amount
        return sorted(names, key=lambda f: not self._within_nominal(w.queue, f, amount))

    def _flavor_names(self, w: Workload) -> list[str]:
        res = w.resources
        if res.gpus_per_node == 0:
            return [CPU_FLAVOR]
        if res.gpu_types:
            return list(res.gpu_types)
        nominal = list(self.queues[w.queue].nominal)
        rest = sorted(f for f in self.cap.ready if f not in nominal and f != CPU_FLAVOR)
        return [f for f in nominal if f != CPU_FLAVOR] + rest

    def _within_nominal(self, queue: str, flavor: str, amount: float) -> bool:
        return self.quotas.used(queue, flavor) + amount <= self.quotas.nominal(queue, flavor)

    def _key(self, w: Workload) -> _Key:
        amount = w.resources.amount
        flavors = self._flavors(w)
        borrows = int(not (flavors and self._within_nominal(w.queue, flavors[0], amount)))
        return (-self._prio(w), borrows, self.quotas.share(w.queue), w.submitted_at, w.id)

    # -- the pass ------------------------------------------------------------------------

    def run(self) -> list[Action]:
        per_queue: dict[str, list[Workload]] = {}
        for w in self.state.workloads:
            if w.status != WorkloadStatus.PENDING:
                continue
            if w.queue not in self.queues:
                self.waiting.append((w, QUOTA, None))
                continue
            per_queue.setdefault(w.queue, []).append(w)
        for items in per_queue.values():
            items.sort(key=lambda w: (-self._prio(w), w.submitted_at, w.id))
        self._merge(per_queue)
        return self.actions + self._waits()

    def _merge(self, per_queue: dict[str, list[Workload]]) -> None:
        """Take the best queue head (rule 1) until every queue is done."""
        index = dict.fromkeys(per_queue, 0)
        heads: dict[str, _Key] = {q: self._key(items[0]) for q, items in per_queue.items()}
        looked = 0
        while heads:
            queue = min(heads, key=lambda q: heads[q])
            w = per_queue[queue][index[queue]]
            index[queue] += 1
            looked += 1
            if looked > self.policy.scan_limit:
                self.waiting.append((w, behind(len(self.waiting)), None))
                preempted = False
            else:
                preempted = self._evaluate(w)
            for q in (list(heads) if preempted else [queue]):
                if index[q] < len(per_queue[q]):
                    heads[q] = self._key(per_queue[q][index[q]])
                else:
                    heads.pop(q, None)

    def _evaluate(self, w: Workload) -> bool:
        """Admit `w` if rules 2-5 allow; else record why it waits. True if it preempted."""
        amount = w.resources.amount
        fixed = not self._class(w).preemptible
        passed: list[str] = []
        flavors = self._flavors(w)
        if not flavors:
            self.waiting.append((w, NO_FITTING_NODES, None))
            return False
        for flavor in flavors:
            if flavor in self.held.get(w.queue, ()) or flavor in self.blocked_flavors:
                continue
            if not self._quota_fits(w, flavor, amount, fixed):
                continue
            passed.append(flavor)
            alloc = self._place(w, flavor)
            if alloc is not None:
                self._admit(w, flavor, alloc)
                return False
        if self._try_preempt(w):
            return True
        self._wait(w, passed)
        return False

    def _quota_fits(self, w: Workload, flavor: str, amount: float, fixed: bool) -> bool:
        cohort = self.queues[w.queue].cohort
        if (cohort, flavor) in self.reclaiming and not self._within_nominal(w.queue, flavor,
                                                                             amount):
            return False
        return self.quotas.fits(w.queue, flavor, amount, fixed=fixed)

    def _relevant(self, w: Workload) -> list[Reservation]:
        """Reservations `w` would delay: all those it could still be running at."""
        estimate = w.runtime_estimate()
        if estimate is None:
            return self.reservations
        end = self.now + estimate
        return [r for r in self.reservations if end > r.start]

    def _place(self, w: Workload, flavor: str) -> Allocation | None:
        res = w.resources
        shape = (flavor, res.gpus_per_node, res.nodes, res.cpus, res.memory_gb, w.avoid)
        if shape in self.no_fit:
            return None
        alloc, _ = self.cap.place(res, flavor, self._relevant(w), w.avoid)
        if alloc is None:
            plain, fitted = self.cap.place(res, flavor, [], w.avoid)
            if plain is None:
                self.no_fit[shape] = fitted if fitted >= 0 else \
                    self.cap.count_fitting(res, flavor, w.avoid)
        return alloc

    def _admit(self, w: Workload, flavor: str, alloc: Allocation) -> None:
        self.cap.take(w.resources, alloc)
        self.quotas.add(w.queue, flavor, w.resources.amount, fixed=not self._class(w).preemptible)
        admitted = replace(w, status=WorkloadStatus.ADMITTED, allocation=alloc, started_at=None)
        self.holding[w.id] = admitted
        self.flavor[w.id] = flavor
        self.actions.append(Admit(workload_id=w.id, allocation=alloc, flavor=flavor))

    def _wait(self, w: Workload, passed: list[str]) -> None:
        """Record the reason; the first run of a queue blocked on nodes gets a reservation."""
        res = w.resources
        if not passed:
            self._hold_quota(w)
            self.waiting.append((w, QUOTA, None))
            return
        flavor = passed[0]
        shape = (flavor, res.gpus_per_node, res.nodes, res.cpus, res.memory_gb, w.avoid)
        if shape not in self.no_fit:
            self.waiting.append((w, behind(len(self._relevant(w))), None))
            return
        reason = GANG_INCOMPLETE if 0 < self.no_fit[shape] < res.nodes else NO_FITTING_NODES
        start = None
        if not self.policy.backfill:
            self.blocked_flavors.update(passed)
        elif (w.queue not in self.reserved_queues
              and len(self.reservations) < self.policy.max_reservations):
            reservation = self._reserve(w, flavor)
            if reservation is not None:
                self.reservations.append(reservation)
                self.reserved_queues.add(w.queue)
                start = reservation.start
        self.waiting.append((w, reason, start))

    def _hold_quota(self, w: Workload) -> None:
        """Guard a quota-blocked run against starvation. Within nominal and short only because
        its quota is lent out: its queue's later runs stay off the flavor and nobody in the
        cohort borrows more of it. Above nominal but able to fit within it: once it has waited
        `starvation_guard_s`, its queue's later runs stay off the flavor (before that, they may
        pass it: holding at once idles quota that smaller runs could use)."""
        amount = w.resources.amount
        cohort = self.queues[w.queue].cohort
        aged = self.now - w.submitted_at >= self.policy.starvation_guard_s
        for flavor in self._flavors(w):
            if self._within_nominal(w.queue, flavor, amount):
                self.held.setdefault(w.queue, set()).add(flavor)
                if cohort is not None:
                    self.reclaiming.add((cohort, flavor))
            elif aged and amount <= self.quotas.nominal(w.queue, flavor):
                self.held.setdefault(w.queue, set()).add(flavor)

    def _waits(self) -> list[Action]:
        positions: dict[str, int] = {}
        out: list[Action] = []
        for w, reason, start in self.waiting:
            positions[w.queue] = positions.get(w.queue, 0) + 1
            out.append(Wait(workload_id=w.id, reason=reason, position=positions[w.queue],
                            estimated_start=start))
        return out

    # -- reservations (rule 4) -----------------------------------------------------------

    def _expected_end(self, h: Workload) -> float:
        start = h.started_at if h.started_at is not None else self.now
        return max(self.now, start + (h.runtime_estimate() or self.policy.assumed_runtime_s))

    def _reserve(self, w: Workload, flavor: str) -> Reservation | None:
        """Replay the holders' expected ends on `flavor` until the gang fits whole."""
        res = w.resources
        claimed: dict[str, set[int]] = {}
        claimed_cpus: dict[str, float] = {}
        for r in self.reservations:
            for name, held_ids in r.gpus.items():
                claimed.setdefault(name, set()).update(held_ids)
            for name, held_cpus in r.cpus.items():
                claimed_cpus[name] = claimed_cpus.get(name, 0.0) + held_cpus
        ready = {n.name for n in self.cap.ready.get(flavor, ()) if n.name not in w.avoid}
        ids = {n: set(self.cap.free_gpus[n]) - claimed.get(n, set()) for n in ready}
        cpus = {n: self.cap.free_cpus[n] - claimed_cpus.get(n, 0.0) for n in ready}
        mem = {n: self.cap.free_mem[n] for n in ready}

        def fits(n: str) -> bool:
            return (len(ids[n]) >= res.gpus_per_node and cpus[n] >= res.cpus
                    and mem[n] >= res.memory_gb)

        fitting = {n for n in ready if fits(n)}
        releases = sorted((self._expected_end(h), h.id) for h in self.holding.values()
                          if self.flavor[h.id] == flavor)
        for end, hid in releases:
            h = self.holding[hid]
            for name, gpu_ids in h.allocation.items():
                if name in ready:
                    ids[name].update(set(gpu_ids) - claimed.get(name, set()))
                    cpus[name] += h.resources.cpus
                    mem[name] += h.resources.memory_gb
                    if fits(name):
                        fitting.add(name)
            if len(fitting) >= res.nodes:
                chosen = sorted(fitting, key=lambda n: (len(ids[n]), cpus[n], n))[: res.nodes]
                return Reservation(
                    workload_id=w.id, start=end,
                    gpus={n: frozenset(sorted(ids[n])[: res.gpus_per_node]) for n in chosen},
                    cpus={n: res.cpus for n in chosen})
        return None

    # -- preemption (rule 5) -------------------------------------------------------------

    def _try_preempt(self, w: Workload) -> bool:
        if not self.policy.preemption or self.attempts >= self.policy.max_preemption_attempts:
            return False
        res, amount = w.resources, w.resources.amount
        memo = (w.queue, self._prio(w), str(res.gpu_types), res.gpus_per_node, res.nodes,
                w.avoid)
        if memo in self.no_preempt:
            return False
        reclaim = any(self._within_nominal(w.queue, f, amount) for f in self._flavors(w))
        if not reclaim and (self.lowest_victim is None or self.lowest_victim >= self._prio(w)):
            return False
        self.attempts += 1
        for flavor in self._flavors(w):
            if flavor in self.held.get(w.queue, ()) or flavor in self.blocked_flavors:
                continue
            victims = self._victims(w, flavor)
            if victims and self._make_room(w, flavor, victims):
                self.no_fit.clear()
                return True
        self.no_preempt.add(memo)
        return False

    def _victims(self, w: Workload, flavor: str) -> list[Workload]:
        """Eligible victims on `flavor`, best first: borrowed, low priority, little lost."""
        amount = w.resources.amount
        within = self._within_nominal(w.queue, flavor, amount)
        cohort = self.queues[w.queue].cohort
        prio = self._prio(w)
        out: list[tuple[tuple[int, int, float, float, str], Workload]] = []
        for vid in self.victim_pool.get(flavor, ()):
            v = self.holding[vid]
            borrowed = self.quotas.borrowing(v.queue, flavor)
            lower = self._prio(v) < prio
            same_cohort = cohort is not None and self.queues[v.queue].cohort == cohort
            if (v.queue == w.queue and lower) or (same_cohort and borrowed and (lower or within)):
                out.append(((int(not borrowed), self._prio(v), self._lost(v), -(v.started_at or
                             0.0), v.id), v))
        out.sort(key=lambda kv: kv[0])
        return [v for _, v in out]

    def _preemptible(self, v: Workload) -> bool:
        if not self._class(v).preemptible or v.started_at is None:
            return False
        if v.status != WorkloadStatus.RUNNING or v.preemptions >= self.policy.max_preemptions:
            return False
        if self.now - v.started_at < self.policy.min_runtime_s:
            return False
        limit = self.policy.max_victim_loss_s
        return limit is None or self._lost(v) <= limit * v.resources.amount

    def _lost(self, v: Workload) -> float:
        """GPU-seconds (CPU-seconds for CPU work) since its last checkpoint."""
        since = v.started_at if v.started_at is not None else self.now
        if v.last_checkpoint_at is not None and v.last_checkpoint_at > since:
            since = v.last_checkpoint_at
        return (self.now - since) * v.resources.amount

    def _release(self, v: Workload) -> None:
        self.cap.give(v.resources, v.allocation)
        self.quotas.add(v.queue, self.flavor[v.id], -v.resources.amount)

    def _restore(self, v: Workload) -> None:
        self.cap.take(v.resources, v.allocation)
        self.quotas.add(v.queue, self.flavor[v.id], v.resources.amount)

    def _fits_now(self, w: Workload, flavor: str) -> Allocation | None:
        res = w.resources
        if not self._quota_fits(w, flavor, res.amount, not self._class(w).preemptible):
            return None
        alloc, _ = self.cap.place(res, flavor, self._relevant(w), w.avoid)
        return alloc

    def _make_room(self, w: Workload, flavor: str, victims: list[Workload]) -> bool:
        """Simulate stopping victims until `w` fits, then keep those not needed after all."""
        chosen: list[Workload] = []
        seen: set[str] = set()
        for v in self._node_victims(w, flavor, victims) + victims:
            if self._fits_now(w, flavor) is not None:
                break
            if v.id not in seen:
                seen.add(v.id)
                self._release(v)
                chosen.append(v)
        if self._fits_now(w, flavor) is None:
            for v in chosen:
                self._restore(v)
            return False
        for v in reversed(list(chosen)):
            self._restore(v)
            if self._fits_now(w, flavor) is not None:
                chosen.remove(v)
            else:
                self._release(v)
        alloc = self._fits_now(w, flavor)
        assert alloc is not None  # the loop above only keeps a victim set that fits
        for v in chosen:
            del self.holding[v.id]
            self.victim_pool[flavor].discard(v.id)
            reason = "reclaim quota" if self.quotas.borrowing(v.queue, flavor) or \
                v.queue != w.queue else "higher priority"
            self.actions.append(Preempt(workload_id=v.id, reason=reason, for_workload=w.id))
        self._admit(w, flavor, alloc)
        return True

    def _node_victims(self, w: Workload, flavor: str, victims: list[Workload]) -> list[Workload]:
        """Victims on the nodes cheapest to clear for the gang (the worst victim a node needs,
        in victim order, then how many), so stopping them frees whole node shapes rather than
        scattered GPUs."""
        res = w.resources
        rank = {v.id: i for i, v in enumerate(victims)}
        on_node: dict[str, list[Workload]] = {}
        for v in victims:
            for name in v.allocation:
                on_node.setdefault(name, []).append(v)
        costs: list[tuple[tuple[int, int, str], list[Workload]]] = []
        for node in self.cap.ready.get(flavor, ()):
            if node.name in w.avoid:
                continue
            need: list[Workload] = []
            for v in on_node.get(node.name, []):
                if self.cap.node_fits(node.name, res, self._relevant(w)):
                    break
                self._release(v)
                need.append(v)
            ok = self.cap.node_fits(node.name, res, self._relevant(w))
            for v in need:
                self._restore(v)
            if ok:
                worst = max((rank[v.id] for v in need), default=-1)
                costs.append(((worst, len(need), node.name), need))
        costs.sort(key=lambda c: c[0])
        out: list[Workload] = []
        seen: set[str] = set()
        for _, need in costs[: res.nodes]:
            for v in need:
                if v.id not in seen:
                    seen.add(v.id)
                    out.append(v)
        return out
