"""Reads for eval suites: access helpers (404 for "not yours"), evaluation reports with
their comparisons, the promotion gate, and the leaderboard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from apps.core.exceptions import NotFound
from apps.evals import gating
from apps.evals.models import (
    EntryResult,
    EvalSuite,
    Promotion,
    ResultStatus,
    SubjectKind,
    SuiteEvaluation,
)
from apps.evals.pareto import pareto_front
from apps.runs.models import Checkpoint, Run
from apps.teams.models import Team

LEADERBOARD_LIMIT = 500
ORDERS = ("capability", "cost", "latency")


def suites(team: Team) -> QuerySet[EvalSuite]:
    return EvalSuite.objects.filter(team=team).select_related("project").order_by("slug")


def access_suite(team: Team, slug: str) -> EvalSuite:
    suite = EvalSuite.objects.filter(team=team, slug=slug).select_related(
        "project", "team").first()
    if suite is None:
        raise NotFound(f"No eval suite '{slug}' in team '{team.slug}'.")
    return suite


def access_evaluation(team: Team, pk: str) -> SuiteEvaluation:
    evaluation = SuiteEvaluation.objects.filter(team=team, pk=int(pk)).select_related(
        "suite", "checkpoint").first() if pk.isdigit() else None
    if evaluation is None:
        raise NotFound(f"No suite evaluation '{pk[:40]}' in team '{team.slug}'.")
    return evaluation


def access_checkpoint(team: Team, pk: str) -> Checkpoint:
    ckpt = Checkpoint.objects.filter(team=team, pk=int(pk)).select_related("run").first() \
        if pk.isdigit() else None
    if ckpt is None:
        raise NotFound(f"No checkpoint '{pk[:40]}' in team '{team.slug}'.")
    return ckpt


def run_resource_seconds(run: Run) -> tuple[float, float]:
    """(CPU-seconds, GPU-seconds) the run's attempts held: each attempt's claim to its end
    (or now) times the cores and GPUs the run requested on each of its nodes. Failed and
    lost attempts count: they were paid for."""
    now = timezone.now()
    held = sum(((a.ended_at or now) - a.claimed_at).total_seconds()
               for a in run.attempts.all())
    resources = run.resources or {}
    nodes = int(resources.get("nodes", 1) or 1)
    cpus = float(resources.get("cpus", 1.0) or 0.0) * nodes
    gpus = float(resources.get("gpus_per_node", 0) or 0) * nodes
    return held * cpus, held * gpus


def _with_results(rows: QuerySet[SuiteEvaluation]) -> QuerySet[SuiteEvaluation]:
    return rows.select_related("checkpoint__run").prefetch_related(Prefetch(
        "results", queryset=EntryResult.objects.select_related("entry", "run").order_by(
            "entry__position")))


def _complete(rows: QuerySet[SuiteEvaluation]) -> QuerySet[SuiteEvaluation]:
    """Evaluations every entry of which succeeded (something to compare with)."""
    return rows.filter(results__isnull=False).exclude(
        results__status__in=(ResultStatus.PENDING, ResultStatus.FAILED)).distinct()


def _previous_id(evaluation: SuiteEvaluation) -> int | None:
    """The previous version's complete evaluation by the same suite: for a checkpoint, the
    latest evaluated earlier checkpoint of the same run; for anything else, the suite's
    latest complete evaluation before this one."""
    rows = _complete(SuiteEvaluation.objects.filter(suite_id=evaluation.suite_id))
    ckpt = evaluation.checkpoint
    if evaluation.subject_kind == SubjectKind.CHECKPOINT and ckpt is not None:
        rows = rows.filter(subject_kind=SubjectKind.CHECKPOINT, checkpoint__run_id=ckpt.run_id,
                           checkpoint__step__lt=ckpt.step).order_by(
            "-checkpoint__step", "-created_at", "-pk")
    else:
        rows = rows.filter(created_at__lte=evaluation.created_at).exclude(
            pk=evaluation.pk).order_by("-created_at", "-pk")
    return rows.values_list("pk", flat=True).first()


def _figures(results: list[EntryResult]) -> gating.Totals:
    return gating.totals([gating.EntryFigures(score=r.score, tasks=r.tasks,
                                              cpu_seconds=r.cpu_seconds,
                                              gpu_seconds=r.gpu_seconds,
                                              latency_s=r.latency_s) for r in results])


def _subject(evaluation: SuiteEvaluation) -> dict[str, Any]:
    ckpt = evaluation.checkpoint
    return {"kind": evaluation.subject_kind, "ref": evaluation.subject_ref,
            "label": evaluation.label,
            "checkpoint": ckpt.pk if ckpt else None,
            "run": str(ckpt.run_id) if ckpt else None,
            "step": ckpt.step if ckpt else None}


def evaluation_report(evaluation: SuiteEvaluation) -> dict[str, Any]:
    return evaluation_reports([evaluation])[0]


def evaluation_reports(evaluations: list[SuiteEvaluation]) -> list[dict[str, Any]]:
    """Each evaluation (newest first) with each entry's result compared with the previous
    version and the suite's baseline, its totals and its verdict. Queries: the evaluations
    with their results, their suites, one look-up of each one's previous version, and the
    scores of all previous versions and baselines at once."""
    rows = list(_with_results(SuiteEvaluation.objects.filter(
        pk__in=[e.pk for e in evaluations])).order_by("-created_at", "-pk"))
    suites = {s.pk: s for s in EvalSuite.objects.filter(pk__in={e.suite_id for e in rows})}
    previous = {e.pk: _previous_id(e) for e in rows}
    wanted = {*previous.values(), *(s.baseline_id for s in suites.values())} - {None}
    scores: dict[int, dict[int, float | None]] = {}
    for ref in EntryResult.objects.filter(evaluation_id__in=wanted).values(
            "evaluation_id", "entry_id", "score"):
        scores.setdefault(ref["evaluation_id"], {})[ref["entry_id"]] = ref["score"]
    return [_report(e, suites[e.suite_id], previous[e.pk], scores) for e in rows]


def _report(evaluation: SuiteEvaluation, suite: EvalSuite, previous: int | None,
            scores: dict[int, dict[int, float | None]]) -> dict[str, Any]:
    baseline = suite.baseline_id if suite.baseline_id != evaluation.pk else None
    before, base = scores.get(previous or 0, {}), scores.get(baseline or 0, {})
    results = list(evaluation.results.all())
    entries, regressions = [], []
    for r in results:
        vs_prev = gating.compare(r.score, before.get(r.entry_id), r.entry.threshold)
        vs_base = gating.compare(r.score, base.get(r.entry_id), r.entry.threshold)
        regressed = r.status == ResultStatus.SUCCEEDED and (vs_prev.regressed or
                                                            vs_base.regressed)
        regressions.append(regressed)
        entries.append({
            "entry": r.entry.position, "metric": r.entry.metric,
            "threshold": r.entry.threshold,
            "environment_version": r.entry.environment_version_id,
            "run": str(r.run_id) if r.run_id else None,
            "run_status": r.run.status if r.run else None,
            "status": r.status, "score": r.score, "mean_reward": r.mean_reward,
            "pass_at": r.pass_at, "tasks": r.tasks, "latency_s": r.latency_s,
            "cpu_seconds": r.cpu_seconds, "gpu_seconds": r.gpu_seconds, "error": r.error,
            "previous": {"score": vs_prev.reference, "delta": vs_prev.delta,
                         "regressed": vs_prev.regressed},
            "baseline": {"score": vs_base.reference, "delta": vs_base.delta,
                         "regressed": vs_base.regressed},
            "regressed": regressed,
        })
    totals = _figures(results)
    return {
        "id": evaluation.pk, "suite": suite.slug, "subject": _subject(evaluation),
        "trigger": evaluation.trigger, "created_at": evaluation.created_at,
        "verdict": gating.verdict([r.status for r in results], regressions),
        "previous": previous, "baseline": baseline,
        "capability": totals.capability, "tasks": totals.tasks,
        "cpu_seconds_per_task": totals.cpu_seconds_per_task,
        "gpu_seconds_per_task": totals.gpu_seconds_per_task,
        "latency_s": totals.latency_s,
        "entries": entries,
    }


def suite_evaluations(suite: EvalSuite, limit: int = 50) -> list[SuiteEvaluation]:
    return list(SuiteEvaluation.objects.filter(suite=suite).order_by("-created_at", "-pk")
                [:limit])


def latest_evaluation(suite: EvalSuite, checkpoint: Checkpoint) -> SuiteEvaluation | None:
    return SuiteEvaluation.objects.filter(suite=suite, checkpoint=checkpoint).order_by(
        "-created_at", "-pk").first()


def promotion_gate(checkpoint: Checkpoint,
                   refresh: Callable[[SuiteEvaluation], None] | None = None) -> dict[str, Any]:
    """What ``promote`` would answer: allowed or not, why (a ``code`` and a message a person
    can act on), and the suite evaluation it rests on. ``refresh`` first records results
    whose runs finished unnoticed (promotion passes it; a read-only look does not)."""
    promoted = Promotion.objects.filter(checkpoint=checkpoint).first()
    slug = (checkpoint.run.config or {}).get("eval_suite")
    gate: dict[str, Any] = {"checkpoint": checkpoint.pk, "suite": slug, "evaluation": None,
                            "verdict": None, "regressions": [],
                            "promoted_at": promoted.created_at if promoted else None}

    def answer(allowed: bool, code: str, message: str) -> dict[str, Any]:
        return {**gate, "allowed": allowed, "code": code, "message": message}

    if not slug:
        return answer(True, "ungated", f"Run {checkpoint.run_id} names no eval_suite: "
                                       "nothing gates its checkpoints.")
    suite = EvalSuite.objects.filter(team_id=checkpoint.team_id, slug=slug).first()
    if suite is None:
        return answer(False, "suite_missing", f"Run {checkpoint.run_id} is gated by eval suite "
                                              f"'{slug}', which no longer exists; recreate it "
                                              "and evaluate the checkpoint.")
    evaluation = latest_evaluation(suite, checkpoint)
    if evaluation is None:
        return answer(False, "not_evaluated",
                      f"Eval suite '{slug}' has not evaluated checkpoint {checkpoint.pk} (step "
                      f"{checkpoint.step}); launch it at POST …/evals/suites/{slug}/evaluate "
                      f"with base_model 'checkpoint:{checkpoint.pk}'.")
    if refresh is not None:
        refresh(evaluation)
    report = evaluation_report(evaluation)
    gate.update(evaluation=evaluation.pk, verdict=report["verdict"],
                regressions=[e for e in report["entries"] if e["regressed"]])
    if report["verdict"] == "pending":
        waiting = sum(1 for e in report["entries"] if e["status"] == "pending")
        return answer(False, "evaluation_pending",
                      f"Eval suite '{slug}' is still evaluating checkpoint {checkpoint.pk}: "
                      f"{waiting} of {len(report['entries'])} eval runs have not finished; "
                      "promote once they have.")
    if report["verdict"] == "failed":
        return answer(False, "evaluation_failed",
                      f"Eval suite '{slug}' could not score checkpoint {checkpoint.pk}: an eval "
                      "run failed (see its entries); evaluate it again.")
    if report["verdict"] == "regressed":
        said = "; ".join(
            f"entry {e['entry']} {e['metric']} {e['score']:.3f}"
            + "".join(f", {w} {e[w]['score']:.3f} (drop {-e[w]['delta']:.3f} > "
                      f"{e['threshold']:.3f})" for w in ("previous", "baseline")
                      if e[w]["regressed"])
            for e in gate["regressions"])
        return answer(False, "regression",
                      f"Eval suite '{slug}' found a regression in checkpoint {checkpoint.pk}: "
                      f"{said}.")
    return answer(True, "passed", f"Eval suite '{slug}' passed checkpoint {checkpoint.pk}.")


def leaderboard(suite: EvalSuite, order: str = "capability") -> list[dict[str, Any]]:
    """The suite's subjects (each one's latest complete evaluation), ranked by ``order``
    (capability high first; cost or latency low first; ties by the others), each with
    whether it is on the Pareto front of capability (max), GPU- and CPU-seconds per task
    (min) and latency (min). Per-task cost keeps GPU and CPU seconds apart (no exchange
    rate between them is assumed): on CPU-only suites the GPU axis is 0 for everyone."""
    if order not in ORDERS:
        order = "capability"
    rows = _with_results(_complete(SuiteEvaluation.objects.filter(suite=suite))
                         .order_by("-created_at", "-pk"))[:LEADERBOARD_LIMIT]
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for evaluation in rows:
        key = (evaluation.subject_kind, str(evaluation.checkpoint_id or evaluation.subject_ref))
        if key in latest:
            continue
        totals = _figures(list(evaluation.results.all()))
        latest[key] = {"evaluation": evaluation.pk, "subject": _subject(evaluation),
                       "created_at": evaluation.created_at,
                       "capability": totals.capability, "tasks": totals.tasks,
                       "gpu_seconds_per_task": totals.gpu_seconds_per_task,
                       "cpu_seconds_per_task": totals.cpu_seconds_per_task,
                       "latency_s": totals.latency_s,
                       "baseline": evaluation.pk == suite.baseline_id}
    board = list(latest.values())
    front = pareto_front([(r["capability"], r["gpu_seconds_per_task"],
                           r["cpu_seconds_per_task"], r["latency_s"]) for r in board],
                         ("max", "min", "min", "min"))
    for row, on_front in zip(board, front, strict=True):
        row["pareto"] = on_front

    def inf(v: float | None) -> float:
        return float("inf") if v is None else v

    def cost(r: dict[str, Any]) -> tuple[float, float]:
        return inf(r["gpu_seconds_per_task"]), inf(r["cpu_seconds_per_task"])

    keys: dict[str, Callable[[dict[str, Any]], tuple[Any, ...]]] = {
        "capability": lambda r: (-(r["capability"] if r["capability"] is not None
                                   else float("-inf")), *cost(r), inf(r["latency_s"])),
        "cost": lambda r: (*cost(r), -(r["capability"] or 0.0), inf(r["latency_s"])),
        "latency": lambda r: (inf(r["latency_s"]), -(r["capability"] or 0.0), *cost(r)),
    }
    board.sort(key=keys[order])
    for rank, row in enumerate(board, start=1):
        row["rank"] = rank
    return board
