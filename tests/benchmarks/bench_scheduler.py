"""Scheduler benchmark: a discrete-event simulation of a shared GPU cluster, run under today's
policy (`workers.scheduling.baseline`: per-pool FIFO by priority, first fit, no quotas, no
preemption) and under `workers.scheduling.decide` on the same seeded workload.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_scheduler` (`make
bench-scheduler`; `--jobs 2000` for a quick look). Ends with one line per figure:
    <figure>: crucible=<value> baseline=<value> ratio=<crucible/baseline> target=<op><value>
Progress goes to stderr. Pass times are the CPU time of the thread running decide(), because on
a shared 2-core machine wall-clock measures the neighbours (at a load average of 7 both policies'
wall-clock p99 rose 4x, ratio unchanged); the wall-clock percentiles are printed to stderr.

The cluster: 1,000 GPUs on 125 nodes of 8 GPUs (50 H100, 50 A100, 25 L40S nodes), 8 teams in
2 cohorts of 4 (each cohort's nominal quota is half of each GPU type, split evenly; one team
lends only half its quota, one may borrow at most 50 GPUs per type), 3 priority classes.

The workload: 10,000 jobs whose shape follows what published traces of shared GPU clusters
report. The figures below are *approximations* read off (and rounded from) these papers, not
fits to the raw traces, which are not available offline here:

- Microsoft Philly (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN
  Training Workloads", USENIX ATC 2019): most jobs ask for one GPU, a minority spans several
  servers; durations range from minutes to weeks; gang (locality) constraints drive queueing
  delay, and failed/killed jobs waste a noticeable share of GPU time.
- SenseTime Helios (Hu et al., "Characterization and Prediction of Deep Learning Workloads in
  Large-Scale GPU Datacenters", SC 2021): single-GPU jobs are the majority of jobs while large
  multi-GPU jobs take most GPU time; submissions follow a clear daily cycle.
- Alibaba PAI (Weng et al., "MLaaS in the Wild", NSDI 2022): a long tail of task durations over
  orders of magnitude, and heavily skewed demand across users/teams.

What this module draws (all approximations chosen to match those shapes):
- GPUs per job: 1 (70%), 2 (7%), 4 (8%), 8 (9%), 16 (3%), 32 (2%), 64 (0.8%), 128 (0.2%);
  jobs above 8 GPUs are gangs of whole 8-GPU nodes.
- Duration: log-normal, median 20 min for 1 GPU growing with gang size (x(1 + 0.5 log2 g)),
  sigma 1.5, clipped to [2 min, 5 days].
- Arrivals: a Poisson process whose rate follows a daily sine (peak 3x the trough), plus bursts
  (10% of jobs, 40-120 jobs of one team within 10 minutes); team demand skewed (weights
  4:3:2:1 within each cohort); offered load about 95% of the cluster over the arrival window.
- Priority: production 15%, default 55%, preemptible 30%. GPU type: 45% any of H100/A100, 35%
  one of them, 20% L40S (jobs of at most 8 GPUs).
- Runtime estimates: 85% declare `max_runtime_s` = actual x U(1, 2.5); 15% declare none.
- Checkpoints every 30 minutes of a run; work since the last one is lost on preemption or node
  failure. Six node failures at random times, each repaired 2-12 hours later.

Figures: `sched_pass_ms_p50/p99` (one decide() call; decide runs only when something happened:
an arrival, a completion, a failure or a repair), `gpu_util` (GPUs allocated over GPUs, over the
arrival window), `goodput` (GPU-time of work kept over GPU-time allocated, the simulation
runs until every job is done; counted by `apps.usage.accounting` from each job's attempts,
checkpoints and holds, the same function as the team usage page and API),
`p95_wait_min_<class>` (all time a job spent pending, including after a preemption),
`preemptions`, `quota_violations` (passes after which a queue or cohort
was above its limits; the baseline knows no quotas).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from apps.runs.goodput import Attempt, CheckpointMark
from apps.usage import accounting
from workers.scheduling import (
    ClusterState,
    Node,
    NodeState,
    Policy,
    QueueSpec,
    Resources,
    Workload,
    WorkloadStatus,
)
from workers.scheduling import baseline as baseline_policy
from workers.scheduling.actions import Action, Admit, Preempt
from workers.scheduling.decide import decide as crucible_decide
from workers.scheduling.ledger import Quotas

MINUTE, HOUR, DAY = 60.0, 3600.0, 86_400.0
CHECKPOINT_S = 30 * MINUTE
FLAVOR_NODES = {"H100": 50, "A100": 50, "L40S": 25}
COHORTS = {"research": ["r1", "r2", "r3", "r4"], "product": ["p1", "p2", "p3", "p4"]}
SIZES = [(1, 0.70), (2, 0.07), (4, 0.08), (8, 0.09), (16, 0.03), (32, 0.02), (64, 0.008),
         (128, 0.002)]
CLASS_MIX = [("production", 0.15), ("default", 0.55), ("preemptible", 0.30)]


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


TEAM_WEIGHTS = (4, 3, 2, 1)  # demand and nominal quota within each cohort


def nominal_quota(rank: int) -> dict[str, float]:
    """Each cohort holds half of every GPU type, split 4:3:2:1 among its teams."""
    share = TEAM_WEIGHTS[rank] / sum(TEAM_WEIGHTS)
    return {f: n * 8 / 2 * share for f, n in FLAVOR_NODES.items()}


def cluster() -> tuple[list[Node], list[QueueSpec]]:
    nodes = [Node(name=f"{flavor.lower()}-{i:03d}", flavor=flavor, gpu_ids=tuple(range(8)),
                  cpus=128, memory_gb=1024)
             for flavor, count in FLAVOR_NODES.items() for i in range(count)]
    queues = []
    for cohort, teams in COHORTS.items():
        for rank, team in enumerate(teams):
            nominal = nominal_quota(rank)
            lend = {f: q / 2 for f, q in nominal.items()} if team == "r1" else None
            borrow = dict.fromkeys(nominal, 50.0) if team == "p4" else None
            queues.append(QueueSpec(name=team, cohort=cohort, nominal=nominal,
                                    lending_limit=lend, borrowing_limit=borrow))
    return nodes, queues


@dataclass
class Job:
    id: str
    team: str
    prio: str
    gpus: int
    types: tuple[str, ...]
    duration: float
    submitted: float
    estimate: float | None


def _pick(rng: random.Random, mix: list[tuple[int, float]] | list[tuple[str, float]]) -> object:
    x, acc = rng.random(), 0.0
    for value, weight in mix:
        acc += weight
        if x < acc:
            return value
    return mix[-1][0]


def _largest_admissible(team: str, prio: str, types: tuple[str, ...]) -> int:
    """The largest power-of-two gang the team's queue can ever admit on these types: a team
    sizes its jobs to its quota (production never borrows; p4 borrows at most 50)."""
    rank = next(ts.index(team) for ts in COHORTS.values() if team in ts)
    nominal = nominal_quota(rank)
    cohort_half = {f: n * 8 / 2 for f, n in FLAVOR_NODES.items()}
    best = 0.0
    for f in types:
        if prio == "production":
            best = max(best, nominal[f])
        else:
            best = max(best, min(cohort_half[f], nominal[f] + (50 if team == "p4" else 1e9)))
    return 2 ** int(math.log2(best))


def workload(n_jobs: int, seed: int, capacity: int = 1000, load: float = 0.95) -> list[Job]:
    """Seeded jobs per the module docstring; the arrival window is sized to the offered load."""
    rng = random.Random(seed)
    teams = [t for ts in COHORTS.values() for t in ts]
    weights = list(TEAM_WEIGHTS) * 2
    drafts = []
    for at, burst_team in _arrivals(rng, n_jobs):
        team = burst_team or rng.choices(teams, weights)[0]
        prio = str(_pick(rng, CLASS_MIX))
        gpus = int(_pick(rng, SIZES))  # type: ignore[call-overload]
        r = rng.random()
        if gpus <= 8 and r < 0.2:
            types: tuple[str, ...] = ("L40S",)
        elif r < 0.55:
            types = (rng.choice(["H100", "A100"]),)
        else:
            types = ("H100", "A100") if rng.random() < 0.5 else ("A100", "H100")
        gpus = min(gpus, _largest_admissible(team, prio, types))
        median = 20 * MINUTE * (1 + 0.5 * math.log2(gpus))
        duration = min(5 * DAY, max(2 * MINUTE, rng.lognormvariate(math.log(median), 1.5)))
        estimate = duration * rng.uniform(1.0, 2.5) if rng.random() < 0.85 else None
        drafts.append((at, team, prio, gpus, types, duration, estimate))
    window = sum(d[3] * d[5] for d in drafts) / (capacity * load)
    return [Job(id=f"j{i:05d}", team=team, prio=prio, gpus=gpus, types=types,
                duration=duration, submitted=at * window, estimate=estimate)
            for i, (at, team, prio, gpus, types, duration, estimate) in enumerate(drafts)]


def _arrivals(rng: random.Random, n: int) -> list[tuple[float, str | None]]:
    """Arrival times on a unit window: diurnal Poisson (peak 3x trough, about 4-5 cycles over
    the window) plus team bursts (10% of jobs), sorted."""
    teams = [t for ts in COHORTS.values() for t in ts]
    cycles = 4.5
    burst_len = 10 * MINUTE / (cycles * DAY)
    out: list[tuple[float, str | None]] = []
    bursty = int(0.1 * n)
    while len(out) < bursty:
        start, team = rng.random(), rng.choice(teams)
        for _ in range(min(rng.randint(40, 120), bursty - len(out))):
            out.append((start + rng.uniform(0, burst_len), team))
    while len(out) < n:
        t = rng.random()
        if rng.random() < (1 + 0.5 * math.sin(2 * math.pi * t * cycles)) / 1.5:
            out.append((t, None))
    return sorted(out, key=lambda x: x[0])


@dataclass
class Run:
    """A job's life in the simulation."""

    job: Job
    workload: Workload
    done: float = 0.0            # seconds of work saved (checkpointed or finished)
    started: float | None = None
    epoch: int = 0
    pending_since: float = 0.0
    waited: float = 0.0
    finished: bool = False
    # Its life as the platform records it, for the shared accounting (apps.usage.accounting):
    # attempts, resumable checkpoints (steps are milliseconds of work done) and holds.
    attempts: list[Attempt] = field(default_factory=list)
    marks: list[CheckpointMark] = field(default_factory=list)
    holds: list[accounting.Hold] = field(default_factory=list)


@dataclass
class Sim:
    nodes: dict[str, Node]
    queues: list[QueueSpec]
    decide: Callable[[ClusterState], list[Action]]
    runs: dict[str, Run] = field(default_factory=dict)
    events: list[tuple[float, int, str, str, int]] = field(default_factory=list)
    seq: int = 0
    busy_gpus: int = 0
    last_t: float = 0.0
    window: float = 0.0
    busy_integral: float = 0.0
    allocated: float = 0.0
    useful: float = 0.0
    pass_ms: list[float] = field(default_factory=list)        # CPU time of the thread
    pass_wall_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    violations: int = 0
    waits: dict[str, list[float]] = field(default_factory=dict)
    unfinished: int = 0

    def push(self, t: float, kind: str, key: str, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, key, epoch))

    def advance(self, t: float) -> None:
        lo, hi = self.last_t, min(t, self.window)
        if hi > lo:
            self.busy_integral += self.busy_gpus * (hi - lo)
        self.last_t = t

    def start(self, run: Run, alloc: dict[str, tuple[int, ...]], now: float) -> None:
        run.waited += now - run.pending_since
        run.started = now
        run.epoch += 1
        run.workload = replace(run.workload, status=WorkloadStatus.RUNNING, allocation=alloc,
                               started_at=now, last_checkpoint_at=None)
        self.busy_gpus += run.job.gpus
        self.push(now + run.job.duration - run.done, "finish", run.job.id, run.epoch)

    def record(self, run: Run, now: float, outcome: str) -> None:
        """The attempt that ends now, its checkpoints (every CHECKPOINT_S of it) and what it
        held, as the platform records them."""
        assert run.started is not None
        for k in range(1, math.floor((now - run.started) / CHECKPOINT_S) + 1):
            run.marks.append(CheckpointMark(step=_ms(run.done + k * CHECKPOINT_S),
                                            created_at=run.started + k * CHECKPOINT_S))
        run.attempts.append(Attempt(len(run.attempts) + 1, outcome, claimed_at=run.started,
                                    ended_at=now, started_at=run.started,
                                    resume_step=_ms(run.done)))
        run.holds.append(accounting.Hold(run.started, now, run.job.gpus, 0.0, "gpu"))

    def account(self, run: Run, now: float) -> None:
        """GPU-seconds allocated and useful, by the accounting the usage page uses."""
        usage = accounting.tally(accounting.pieces(run.attempts, run.marks, run.holds, now=now,
                                                   finished_at=now))
        self.allocated += usage.allocated_gpu_s
        self.useful += usage.gpu_s["useful"]

    def stop(self, run: Run, now: float, *, preempted: bool) -> None:
        """Back to pending; work since the last checkpoint of this segment is lost."""
        assert run.started is not None
        self.record(run, now, "preempted" if preempted else "lost")
        run.done += math.floor((now - run.started) / CHECKPOINT_S) * CHECKPOINT_S
        self.busy_gpus -= run.job.gpus
        run.started, run.epoch, run.pending_since = None, run.epoch + 1, now
        run.workload = replace(run.workload, status=WorkloadStatus.PENDING, allocation={},
                               started_at=None, last_checkpoint_at=None,
                               preemptions=run.workload.preemptions + int(preempted))

    def finish(self, run: Run, now: float) -> None:
        assert run.started is not None
        self.record(run, now, "succeeded")
        self.account(run, now)
        self.busy_gpus -= run.job.gpus
        run.finished, run.started = True, None
        del self.runs[run.job.id]

    def snapshot(self, now: float) -> ClusterState:
        workloads = []
        for run in self.runs.values():
            w = run.workload
            if run.started is not None:
                mark = run.started + math.floor((now - run.started) / CHECKPOINT_S) * CHECKPOINT_S
                if mark > run.started and w.last_checkpoint_at != mark:
                    w = run.workload = replace(w, last_checkpoint_at=mark)
            workloads.append(w)
        return ClusterState(nodes=tuple(self.nodes.values()), queues=tuple(self.queues),
                            workloads=tuple(workloads), now=now)

    def one_pass(self, now: float) -> None:
        state = self.snapshot(now)
        c0, t0 = time.thread_time(), time.perf_counter()
        actions = self.decide(state)
        self.pass_ms.append((time.thread_time() - c0) * 1000)
        self.pass_wall_ms.append((time.perf_counter() - t0) * 1000)
        for a in actions:
            if isinstance(a, Preempt):
                self.preemptions += 1
                self.stop(self.runs[a.workload_id], now, preempted=True)
        for a in actions:
            if isinstance(a, Admit):
                self.start(self.runs[a.workload_id], dict(a.allocation), now)
        holders = [r.workload for r in self.runs.values() if r.started is not None]
        if Quotas.of(state, holders, self.nodes).violations():
            self.violations += 1

    def fail(self, name: str, now: float, repair_after: float) -> None:
        self.nodes[name] = replace(self.nodes[name], state=NodeState.LOST)
        for run in list(self.runs.values()):
            if run.started is not None and name in run.workload.allocation:
                self.stop(run, now, preempted=False)
        self.push(now + repair_after, "repair", name)


def simulate(jobs: list[Job], decide: Callable[[ClusterState], list[Action]], seed: int,
             label: str) -> Sim:
    nodes, queues = cluster()
    sim = Sim(nodes={n.name: n for n in nodes}, queues=queues, decide=decide)
    sim.window = max(j.submitted for j in jobs)
    rng = random.Random(seed + 1)
    for j in jobs:
        sim.push(j.submitted, "arrive", j.id)
    by_id = {j.id: j for j in jobs}
    for _ in range(6):
        sim.push(rng.uniform(0.1, 0.9) * sim.window, "fail", rng.choice(nodes).name,
                 int(rng.uniform(2, 12) * HOUR))
    waits: dict[str, list[float]] = {c: [] for c, _ in CLASS_MIX}
    finished = 0
    while sim.events:
        now = sim.events[0][0]
        sim.advance(now)
        while sim.events and sim.events[0][0] == now:
            _, _, kind, key, epoch = heapq.heappop(sim.events)
            if kind == "arrive":
                j = by_id[key]
                res = Resources(gpus_per_node=min(j.gpus, 8), nodes=max(1, j.gpus // 8),
                                gpu_types=j.types, cpus=4, memory_gb=32,
                                max_runtime_s=j.estimate)
                w = Workload(id=j.id, queue=j.team, priority=j.prio, resources=res,
                             submitted_at=j.submitted)
                sim.runs[j.id] = Run(job=j, workload=w, pending_since=now)
            elif kind == "finish":
                run = sim.runs.get(key)
                if run is not None and run.epoch == epoch and run.started is not None:
                    waits[run.job.prio].append(run.waited / MINUTE)
                    sim.finish(run, now)
                    finished += 1
            elif kind == "fail":
                if sim.nodes[key].state == NodeState.READY:
                    sim.fail(key, now, epoch)
            elif kind == "repair":
                sim.nodes[key] = replace(sim.nodes[key], state=NodeState.READY)
        sim.one_pass(now)
        if len(sim.pass_ms) % 2000 == 0:
            note(f"{label}: t={now / DAY:.1f} d, {finished} finished, {len(sim.runs)} in system")
    end = sim.last_t
    for run in sim.runs.values():  # never admitted: their wait so far counts, and is reported
        if run.attempts:  # stopped and never restarted: what it held still counts
            sim.account(run, end)
        waits[run.job.prio].append((run.waited + end - run.pending_since) / MINUTE)
    sim.unfinished = len(sim.runs)
    sim.waits = waits
    return sim


def _ms(seconds: float) -> int:
    """A checkpoint's step: milliseconds of the job's work done (steps are integers)."""
    return round(seconds * 1000)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def _line(figure: str, ours: float, theirs: float, target: str = "", digits: int = 3) -> str:
    ratio = f"{ours / theirs:.2f}" if theirs else "1.00" if not ours else "inf"
    tail = f" target={target}" if target else ""
    return (f"{figure}: crucible={ours:.{digits}f} baseline={theirs:.{digits}f} "
            f"ratio={ratio}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--only", choices=["baseline", "crucible"], default=None)
    args = parser.parse_args()
    jobs = workload(args.jobs, args.seed)
    note(f"{len(jobs)} jobs over {max(j.submitted for j in jobs) / DAY:.1f} days of arrivals, "
         f"{sum(j.gpus * j.duration for j in jobs) / 3600:.0f} GPU-hours of work")
    results = {}
    policy = Policy()
    for label, fn in (("baseline", baseline_policy.decide),
                      ("crucible", lambda s: crucible_decide(s, policy))):
        if args.only and label != args.only:
            continue
        t0 = time.perf_counter()
        results[label] = simulate(jobs, fn, args.seed, label)
        note(f"{label}: simulated in {time.perf_counter() - t0:.0f} s, "
             f"{len(results[label].pass_ms)} passes, {results[label].unfinished} never ran")
    if args.only:
        return
    ours, theirs = results["crucible"], results["baseline"]
    for label, sim in results.items():
        note(f"{label}: pass wall-clock p50 {_pct(sim.pass_wall_ms, 0.5):.2f} ms, p99 "
             f"{_pct(sim.pass_wall_ms, 0.99):.2f} ms (CPU time: p50 {_pct(sim.pass_ms, 0.5):.2f}, "
             f"p99 {_pct(sim.pass_ms, 0.99):.2f})")

    def util(s: Sim) -> float:
        return s.busy_integral / (1000 * s.window)

    lines = [
        _line("sched_pass_ms_p50", _pct(ours.pass_ms, 0.5), _pct(theirs.pass_ms, 0.5), "", 2),
        _line("sched_pass_ms_p99", _pct(ours.pass_ms, 0.99), _pct(theirs.pass_ms, 0.99),
              "<=5", 2),
        _line("gpu_util", util(ours), util(theirs)),
        _line("goodput", ours.useful / ours.allocated, theirs.useful / theirs.allocated,
              ">=0.98"),
    ]
    for cls, _ in CLASS_MIX:
        lines.append(_line(f"p95_wait_min_{cls}", _pct(ours.waits[cls], 0.95),
                           _pct(theirs.waits[cls], 0.95), "", 1))
    lines.append(_line("preemptions", ours.preemptions, theirs.preemptions, "", 0))
    lines.append(_line("quota_violations", ours.violations, theirs.violations, "<=0", 0))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
