"""`synthesize(config, progress_callback) -> Batch`: generate, verify in stages, deduplicate.

Stages, in order, each counted with its rejection reasons:
  generate   build the item (a degenerate draw, an unreachable endpoint... is rejected here)
  syntax     well formed: expressions parse (whitelisted), code compiles, model replies parse
  logic      the answer re-derived independently; code: reference outputs + oracle agreement
  dedup_exact / dedup_near   normalised-text duplicates, then MinHash LSH near duplicates
Records come out in plan order (generator by generator, item by item), and every random draw is
seeded from (run seed, generator index, item index), so the same config gives byte-identical
records however many pool processes did the work. The human spot-check happens after this, in
the review app; this engine hands over the verified candidate batch.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from workers.reporting import Reporter, Stopped

from . import quality
from .items import CodeTask, MathTask, Outcome, code_outcome, run_math_tasks
from .records import derive_seed, record_uid, records_digest, to_jsonl
from .spec import (
    AdversarialGenerator,
    CodeGenerator,
    MathGenerator,
    ModelGenerator,
    SynthesisConfig,
)

FORMAT = "crucible.synthesis.batch/1"
STAGES = ("generate", "syntax", "logic", "dedup_exact", "dedup_near")
_CHUNK = 64
_EXAMPLES_PER_REASON = 3


class SynthesisError(RuntimeError):
    """The run cannot proceed (sandbox missing, endpoint unreachable); nothing was produced."""


@dataclass(frozen=True)
class Progress:
    """One progress report: `done` of `total` items through `stage`."""

    stage: str
    done: int
    total: int


ProgressCallback = Callable[[Progress], None]


class ItemProgress:
    """A progress callback that reports through a :class:`workers.reporting.Reporter`:
    ``items_done`` / ``items_total`` metrics at most once every ``every_s`` seconds (and at
    ``done``), and :class:`Stopped` as soon as the reporter says to stop. Dedup is not counted:
    the generating stages are what the items are."""

    STAGES = ("math", "model", "code")

    def __init__(self, reporter: Reporter, total: int, every_s: float = 1.0) -> None:
        self.reporter, self.total, self.every_s = reporter, total, every_s
        self.stages: dict[str, int] = {}
        self.step, self.last = 0, 0.0

    def __call__(self, progress: Progress) -> None:
        if self.reporter.should_stop():
            raise Stopped("synthesis stopped: the run was canceled or its lease lost")
        if progress.stage in self.STAGES:
            self.stages[progress.stage] = progress.done
        now = time.monotonic()
        if progress.stage == "done" or now - self.last >= self.every_s:
            self.flush()
            self.last = now

    def flush(self) -> None:
        """One more metric point (a step per report), now."""
        self.step += 1
        self.reporter.log(self.step, {"items_done": sum(self.stages.values()),
                                      "items_total": self.total})


@dataclass
class Batch:
    """Verified candidate records, the rejected ones with reasons, and the manifest."""

    records: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    manifest: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase; outside the manifest so that the manifest is reproducible."""

    @property
    def digest(self) -> str:
        """The dataset version id these records get (SHA-256 of their canonical lines)."""
        return self.manifest["records_digest"]

    def jsonl(self) -> bytes:
        return to_jsonl(self.records)


def _round_robin(values: list[Any], i: int, every: int = 1) -> Any:
    return values[(i // every) % len(values)]


def _plan(config: SynthesisConfig) -> Iterator[tuple[int, int, Any, int]]:
    """(global index, generator index, generator spec, item index) for every requested item."""
    index = 0
    for gi, gen in enumerate(config.generators):
        for i in range(gen.count):
            yield index, gi, gen, i
            index += 1


def _pool_map(tasks: list[MathTask], workers: int,
              done: Callable[[int], None]) -> tuple[list[Outcome], float]:
    size = max(1, min(_CHUNK, -(-len(tasks) // (4 * workers))))  # a few chunks per worker
    chunks = [tasks[i:i + size] for i in range(0, len(tasks), size)]
    results: list[Outcome] = []
    cpu = 0.0
    # Pool processes need a non-daemonic parent (a Celery prefork child is daemonic): run inline.
    if workers <= 1 or len(chunks) <= 1 or multiprocessing.current_process().daemon:
        parts: Iterator[tuple[list[Outcome], float]] = map(run_math_tasks, chunks)
        for part, seconds in parts:
            results.extend(part)
            cpu += seconds
            done(len(results))
        return results, cpu
    # forkserver: workers fork from a clean process that preloaded sympy, not from this one
    # (which may hold sandbox or HTTP threads); callers' scripts need a __main__ guard.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["workers.synthesis.items"])
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for part, seconds in pool.map(run_math_tasks, chunks):
            results.extend(part)
            cpu += seconds
            done(len(results))
    return results, cpu


def _stage_stats(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    stats = []
    remaining = len(outcomes)
    for stage in STAGES:
        reasons = Counter(o.reason for o in outcomes if o.stage == stage)
        rejected = sum(reasons.values())
        stats.append({"stage": stage, "in": remaining, "passed": remaining - rejected,
                      "rejected": rejected, "reasons": dict(sorted(reasons.items()))})
        remaining -= rejected
    return stats


def synthesize(
    config: SynthesisConfig, progress_callback: ProgressCallback | None = None, *,
    engine: Any = None,
) -> Batch:
    """Run one synthesis config to a verified candidate batch.

    `engine` is a `workers.sandbox.Engine` for code items (default: the process-wide one).
    Raises SynthesisError when a needed facility is missing; bad items never raise, they are
    rejected with a reason."""
    report = progress_callback or (lambda _p: None)
    timings: dict[str, float] = {}
    started = time.perf_counter()

    math_tasks: list[MathTask] = []
    code_tasks: list[CodeTask] = []
    model_tasks: list[tuple[Any, ModelGenerator]] = []
    for index, gi, gen, i in _plan(config):
        seed = derive_seed(config.seed, gi, i)
        if isinstance(gen, MathGenerator):
            t = len(gen.topics)
            math_tasks.append(MathTask(index, gi, _round_robin(gen.topics, i),
                                       _round_robin(gen.difficulties, i, t), seed))
        elif isinstance(gen, CodeGenerator):
            t = len(gen.families)
            code_tasks.append(CodeTask(index, gi, _round_robin(gen.families, i),
                                       _round_robin(gen.difficulties, i, t), seed,
                                       gen.tests_per_item))
        elif isinstance(gen, AdversarialGenerator):
            pert = _round_robin(gen.perturbations, i)
            fallback = next((p for p in gen.perturbations if p != "rename"), None)
            every = len(gen.perturbations)
            if gen.source == "math":
                t = len(gen.topics)
                math_tasks.append(MathTask(
                    index, gi, _round_robin(gen.topics, i, every),
                    _round_robin(gen.difficulties, i, t * every), seed, pert, fallback))
            else:
                t = len(gen.families)
                code_tasks.append(CodeTask(
                    index, gi, _round_robin(gen.families, i, every),
                    _round_robin(gen.difficulties, i, t * every), seed, gen.tests_per_item,
                    pert, fallback))
        else:
            from .model_items import ModelTask

            t = len(gen.topics)
            model_tasks.append((ModelTask(index, gi, _round_robin(gen.topics, i),
                                          _round_robin(gen.difficulties, i, t), seed), gen))

    if code_tasks:
        from .code_stage import sandbox_unavailable

        reason = sandbox_unavailable() if engine is None else None
        if reason:
            raise SynthesisError(f"code generators need the sandbox engine: {reason}")

    outcomes: list[Outcome] = []
    total_math = len(math_tasks)
    math_outcomes, math_cpu = _pool_map(math_tasks, config.workers,
                                        lambda n: report(Progress("math", n, total_math)))
    outcomes.extend(math_outcomes)
    timings["math_s"] = time.perf_counter() - started
    timings["math_cpu_s"] = math_cpu

    if model_tasks:
        t0 = time.perf_counter()
        outcomes.extend(_run_model(model_tasks, report))
        timings["model_s"] = time.perf_counter() - t0

    if code_tasks:
        t0 = time.perf_counter()
        from .code_stage import run_code_stage

        pairs = []
        for task in code_tasks:
            out, built = code_outcome(task)
            outcomes.append(out)
            if built is not None:
                pairs.append((out, built))
        if engine is None:
            from workers.sandbox import default_engine

            engine = default_engine()
        total_code = len(pairs)
        run_code_stage(pairs, engine, config.sandbox_concurrency,
                       lambda n: report(Progress("code", n, total_code)))
        timings["code_s"] = time.perf_counter() - t0

    outcomes.sort(key=lambda o: o.index)
    t0 = time.perf_counter()
    _deduplicate(config, outcomes, report)
    timings["dedup_s"] = time.perf_counter() - t0
    batch = _assemble(config, outcomes)
    timings["total_s"] = time.perf_counter() - started
    batch.timings = {k: round(v, 3) for k, v in timings.items()}
    report(Progress("done", len(batch.records), len(outcomes)))
    return batch


def _run_model(tasks: list[tuple[Any, ModelGenerator]],
               report: ProgressCallback) -> list[Outcome]:
    from concurrent.futures import ThreadPoolExecutor

    from .model_items import ChatClient, model_outcome

    results: list[Outcome] = []
    by_gen: dict[int, list[Any]] = {}
    for task, gen in tasks:
        by_gen.setdefault(task.generator, []).append((task, gen))
    for group in by_gen.values():
        gen = group[0][1]
        client = ChatClient(gen.endpoint)
        try:
            with ThreadPoolExecutor(max_workers=gen.endpoint.concurrency) as pool:
                for out in pool.map(model_outcome, [t for t, _ in group], [gen] * len(group),
                                    [client] * len(group)):
                    results.append(out)
                    report(Progress("model", len(results), len(tasks)))
        finally:
            client.close()
        errors = [o for o in results[-len(group):] if o.reason == "generate:endpoint_error"]
        if len(errors) == len(group):
            raise SynthesisError(f"the endpoint {gen.endpoint.base_url} answered no request: "
                                 f"{errors[0].detail}")
    return results


def _deduplicate(config: SynthesisConfig, outcomes: list[Outcome],
                 report: ProgressCallback) -> None:
    alive = [o for o in outcomes if o.stage is None]
    texts = [o.record["question"] for o in alive]
    report(Progress("dedup", 0, len(alive)))
    exact = quality.exact_duplicates(texts)
    for i, j in exact.items():
        alive[i].reject("dedup_exact", "dedup:exact", f"same text as item {alive[j].index}")
    if config.dedup.near:
        near = quality.near_duplicates(
            texts, threshold=config.dedup.threshold, num_perm=config.dedup.num_perm,
            shingle=config.dedup.shingle, skip=set(exact))
        for dup in near:
            alive[dup.index].reject("dedup_near", "dedup:near",
                                    f"estimated Jaccard {dup.similarity} with item "
                                    f"{alive[dup.of].index}")
    for o in alive:
        if o.stage is None:
            o.passed("dedup", "unique", "no exact or near duplicate earlier in the batch")
    report(Progress("dedup", len(alive), len(alive)))


def _finish(out: Outcome) -> dict[str, Any]:
    record = dict(out.record)
    record["uid"] = record_uid(record)
    record["verification"] = out.trail
    return record


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"engine": FORMAT}
    for name in ("sympy", "datasketch"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    return found


def _assemble(config: SynthesisConfig, outcomes: list[Outcome]) -> Batch:
    records = [_finish(o) for o in outcomes if o.stage is None]
    rejected = [{**_finish(o), "rejected": {"stage": o.stage, "reason": o.reason,
                                            "detail": o.detail}}
                for o in outcomes if o.stage is not None]
    examples: dict[str, list[dict[str, Any]]] = {}
    for r in rejected:
        bucket = examples.setdefault(r["rejected"]["reason"], [])
        if len(bucket) < _EXAMPLES_PER_REASON:
            bucket.append({"uid": r["uid"], "detail": r["rejected"]["detail"][:300]})
    per_generator = []
    for gi, gen in enumerate(config.generators):
        mine = [o for o in outcomes if o.generator == gi]
        per_generator.append({"index": gi, "kind": gen.kind, "requested": gen.count,
                              "accepted": sum(o.stage is None for o in mine),
                              "rejected": dict(sorted(Counter(
                                  o.stage for o in mine if o.stage is not None).items()))})
    by_kind = Counter(r["kind"] for r in records)
    manifest = {
        "format": FORMAT,
        "name": config.name,
        "seed": config.seed,
        "parents": list(config.parents),
        "config": config.public_dict(),
        "record_count": len(records),
        "records_digest": records_digest(records),
        "candidates": len(outcomes),
        "accepted": len(records),
        "kinds": dict(sorted(by_kind.items())),
        "stages": _stage_stats(outcomes),
        "generators": per_generator,
        "rejection_examples": dict(sorted(examples.items())),
        "diversity": quality.distinct_n([r["question"] for r in records], config.distinct_n),
        "versions": _versions(),
    }
    return Batch(records=records, rejected=rejected, manifest=manifest)
