"""Writes for eval suites: suites, evaluations (one eval run per entry), their results when
the runs finish, and promotion of checkpoints gated by a suite.

Runs call in through ``apps.runs.hooks`` (registered in ``EvalsConfig.ready``): a new
checkpoint of a run whose config names ``eval_suite`` launches an evaluation; a finished
eval run copies its report's figures into its result row.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from pydantic import ValidationError

from apps.core import audit, limits
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, DomainError, InvalidInput
from apps.evals import selectors
from apps.evals.models import (
    EntryResult,
    EvalSuite,
    Promotion,
    ResultStatus,
    ServedVariant,
    SubjectKind,
    SuiteEntry,
    SuiteEvaluation,
    VariantKind,
)
from apps.lineage import services as lineage
from apps.projects.selectors import project_by_slug
from apps.runs import objects
from apps.runs.launch import run_launch
from apps.runs.models import Checkpoint, Run, RunKind, RunStatus
from apps.runs.selectors import resolve_checkpoint
from apps.runs.specs import KINDS
from apps.runs.validation.pins import pin_environments
from apps.teams.models import Team
from workers.envs.spec import EndpointPolicySpec, EvalParams
from workers.rl.spec import ServingSpec

log = logging.getLogger(__name__)

MAX_ENTRIES = 32
DEFAULT_THRESHOLD = 0.05
ENTRY_KEYS = {"environment", "metric", "threshold"}


# --- suites ----------------------------------------------------------------------------------


def _entry(team: Team, index: int, raw: Any) -> dict[str, Any]:
    """One entry of a create request, validated: the environment version resolved (and
    allowed for eval runs: QC not failed), the eval parameters checked by the eval run's own
    schema, the metric one the run reports."""
    where = f"entries[{index}]"
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where} must be an object.", details={where: ["object"]})
    ref = raw.get("environment")
    if not isinstance(ref, str) or not ref:
        raise InvalidInput(f"{where}.environment: give an environment version "
                           "('<slug>@v<n>' or '<slug>@<digest>').",
                           details={f"{where}.environment": ["required"]})
    try:
        version = pin_environments(team, KINDS["eval"], "eval", ref, None)[0]
    except InvalidInput as exc:
        raise InvalidInput(f"{where}.environment: {exc.message}",
                           details={f"{where}.environment": [exc.message]}) from exc
    params = {k: v for k, v in raw.items() if k not in ENTRY_KEYS}
    try:
        parsed = EvalParams.model_validate(params)
        parsed._check_k()  # the eval run's own k <= samples_per_task rule
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in (where, *err["loc"]))
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise InvalidInput(f"{field}: {message}", details={field: [message]}) from exc
    except ValueError as exc:
        raise InvalidInput(f"{where}.k: {exc}", details={f"{where}.k": [str(exc)]}) from exc
    metric = raw.get("metric", f"pass@{max(parsed.k)}")
    allowed = {"mean_reward", *(f"pass@{k}" for k in parsed.k)}
    if metric not in allowed:
        raise InvalidInput(f"{where}.metric must be one of {', '.join(sorted(allowed))} (pass@k "
                           "needs k among the entry's k).",
                           details={f"{where}.metric": [str(metric)[:40]]})
    threshold = raw.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or \
            not math.isfinite(threshold) or not 0 <= threshold <= 1:
        raise InvalidInput(f"{where}.threshold must be a number from 0 to 1 (the absolute drop "
                           "of the metric that counts as a regression).",
                           details={f"{where}.threshold": [str(threshold)[:40]]})
    return {"environment_version": version, "params": parsed.model_dump(mode="json"),
            "metric": metric, "threshold": float(threshold)}


def suite_create(*, actor: Actor, team: Team, slug: str, project: str, entries: list[Any],
                 name: str = "", description: str = "") -> EvalSuite:
    limits.check_text(description, field="description", limit=limits.DESCRIPTION)
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_ENTRIES:
        raise InvalidInput(f"entries must be a list of 1 to {MAX_ENTRIES} evaluations.",
                           details={"entries": ["1 to 32 items"]})
    project_obj = project_by_slug(team=team, slug=project)
    checked = [_entry(team, i, raw) for i, raw in enumerate(entries)]
    try:
        with transaction.atomic():
            suite = EvalSuite.objects.create(team=team, project=project_obj, slug=slug,
                                             name=name or slug, description=description,
                                             created_by=actor.user)
            SuiteEntry.objects.bulk_create(SuiteEntry(suite=suite, position=i, **e)
                                           for i, e in enumerate(checked))
            audit.record(actor=actor, action="evals.suite.create", team_id=team.pk,
                         target_type="eval_suite", target_id=slug,
                         data={"entries": len(checked), "project": project})
    except IntegrityError as exc:
        raise Conflict(f"Eval suite '{slug}' already exists in team '{team.slug}'.") from exc
    return suite


def suite_update(*, actor: Actor, suite: EvalSuite, **fields: Any) -> EvalSuite:
    """Name, description and baseline; entries are frozen (a new set of tasks is a new
    suite, so every evaluation of one suite stays comparable)."""
    with transaction.atomic():
        suite = EvalSuite.objects.select_for_update().get(pk=suite.pk)
        changed: dict[str, Any] = {}
        if "description" in fields:
            limits.check_text(fields["description"], field="description",
                              limit=limits.DESCRIPTION)
        for key in ("name", "description"):
            if key in fields:
                setattr(suite, key, fields[key])
                changed[key] = fields[key]
        if "baseline" in fields:
            suite.baseline = _baseline(suite, fields["baseline"])
            changed["baseline"] = suite.baseline_id
        suite.save()
        audit.record(actor=actor, action="evals.suite.update", team_id=suite.team_id,
                     target_type="eval_suite", target_id=suite.slug, data=changed)
    return suite


def _baseline(suite: EvalSuite, value: int | None) -> SuiteEvaluation | None:
    if value is None:
        return None
    evaluation = suite.evaluations.filter(pk=value).first()
    if evaluation is None:
        raise InvalidInput(f"baseline: suite '{suite.slug}' has no evaluation {value}.",
                           details={"baseline": [str(value)]})
    refresh(evaluation)
    if evaluation.results.exclude(status=ResultStatus.SUCCEEDED).exists():
        raise InvalidInput(f"baseline: evaluation {value} has not succeeded on every entry; "
                           "a baseline needs a score for each.",
                           details={"baseline": [str(value)]})
    return evaluation


def suite_delete(*, actor: Actor, suite: EvalSuite) -> None:
    """The suite and its evaluations go; the eval runs stay (they are runs) and so do the
    promotions it allowed."""
    with transaction.atomic():
        audit.record(actor=actor, action="evals.suite.delete", team_id=suite.team_id,
                     target_type="eval_suite", target_id=suite.slug)
        suite.delete()


# --- evaluations -----------------------------------------------------------------------------


def evaluate(*, actor: Actor, suite: EvalSuite, subject_kind: str, label: str,
             base_model: str | None = None, policy: dict[str, Any] | None = None,
             checkpoint: Checkpoint | None = None, trigger: str = "manual",
             serving: dict[str, Any] | None = None) -> SuiteEvaluation:
    """Launch one ``eval`` run per entry of ``suite`` on one subject, all or none (a launch
    the runs app refuses, e.g. an environment version that has since failed QC, aborts the
    whole evaluation with its message). The subject is ``base_model`` (any reference the
    runs API takes: ``checkpoint:<id>``, ``preset``, ``path:/dir``) or ``policy`` (an
    OpenAI-compatible endpoint). ``serving`` (a served variant's settings: int8 weights,
    speculative decoding) goes into each eval run's config, so the worker serves the model
    exactly as the variant is served."""
    if (base_model is None) == (policy is None):
        raise InvalidInput("Give the subject once: base_model or policy.",
                           details={"base_model": ["or policy"]})
    if policy is not None:
        try:
            endpoint = EndpointPolicySpec.model_validate(policy)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in ("policy", *err["loc"]))
            raise InvalidInput(f"{field}: {err['msg']}", details={field: [err["msg"]]}) from exc
        subject_ref = endpoint.base_url
    else:
        subject_ref = str(base_model)
    limits.check_text(label, field="label", limit=limits.NAME)
    with transaction.atomic():
        evaluation = SuiteEvaluation.objects.create(
            team_id=suite.team_id, suite=suite, subject_kind=subject_kind,
            checkpoint=checkpoint, subject_ref=subject_ref[:1000], label=label[:200],
            trigger=trigger, created_by=actor.user)
        team = suite.team
        for entry in suite.entries.select_related("environment_version__environment"):
            version = entry.environment_version
            config = dict(entry.params)
            if policy is not None:
                config["policy"] = policy
            if serving:
                config["serving"] = serving
            launched = run_launch(actor=actor, team=team, document={
                "project": suite.project.slug, "kind": RunKind.EVAL, "config": config,
                "name": f"{suite.slug}/{entry.position}: {label}"[:200],
                "base_model": base_model,
                "environment": f"{version.environment.slug}@v{version.number}",
                "tags": ["eval-suite"]})
            EntryResult.objects.create(evaluation=evaluation, entry=entry, run=launched.run)
        audit.record(actor=actor, action="evals.evaluate", team_id=suite.team_id,
                     target_type="eval_suite", target_id=suite.slug,
                     data={"evaluation": evaluation.pk, "subject": subject_ref[:300],
                           "trigger": trigger})
    return evaluation


def evaluate_variant(*, actor: Actor, suite: EvalSuite, label: str,
                     policy: dict[str, Any] | None = None, model_dir: str | None = None,
                     source: Checkpoint | None = None,
                     serving: dict[str, Any] | None = None) -> SuiteEvaluation:
    """Evaluate a served variant (a model derived from a checkpoint: quantised,
    speculative, …): by its endpoint (``policy``), its model folder on the workers
    (``model_dir``), or its source checkpoint served by the eval workers with the variant's
    ``serving`` settings (what ``variant_create`` does)."""
    if policy is None and model_dir is None and source is not None:
        base_model: str | None = f"checkpoint:{source.pk}"
    else:
        base_model = None if model_dir is None else f"path:{model_dir}"
    return evaluate(actor=actor, suite=suite, subject_kind=SubjectKind.VARIANT, label=label,
                    base_model=base_model, policy=policy, checkpoint=source, trigger="variant",
                    serving=serving)


# --- served variants -------------------------------------------------------------------------


def _variant_serving(kind: str, *, int8: bool, ngram: int | None,
                     num_speculative_tokens: int | None, draft: Checkpoint | None
                     ) -> dict[str, Any]:
    """The serve flags of a variant kind, checked by the eval run's own schema."""
    if kind not in VariantKind.values:
        raise InvalidInput(f"kind must be one of {', '.join(VariantKind.values)}.",
                           details={"kind": [str(kind)[:40]]})
    if kind == VariantKind.DRAFT and draft is None:
        raise InvalidInput("A 'draft' variant needs draft_checkpoint ('checkpoint:<id>' or "
                           "'run:<id>[@<step>]' of a smaller model with the same tokenizer).",
                           details={"draft_checkpoint": ["required for kind 'draft'"]})
    if kind != VariantKind.DRAFT and draft is not None:
        raise InvalidInput("draft_checkpoint is for kind 'draft' only.",
                           details={"draft_checkpoint": ["only for kind 'draft'"]})
    if kind != VariantKind.NGRAM and ngram is not None:
        raise InvalidInput("ngram is for kind 'ngram' only.", details={"ngram": ["ngram only"]})
    if kind == VariantKind.INT8 and num_speculative_tokens is not None:
        raise InvalidInput("num_speculative_tokens is for the speculative kinds (ngram, draft).",
                           details={"num_speculative_tokens": ["speculative kinds only"]})
    raw: dict[str, Any] = {"int8": bool(int8 or kind == VariantKind.INT8)}
    if kind == VariantKind.NGRAM:
        raw["ngram_draft"] = 3 if ngram is None else ngram
        if raw["ngram_draft"] < 1:
            raise InvalidInput("ngram must be from 1 to 16.", details={"ngram": [str(ngram)]})
    if kind != VariantKind.INT8 and num_speculative_tokens is not None:
        raw["num_speculative_tokens"] = num_speculative_tokens
    try:
        parsed = ServingSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = {"ngram_draft": "ngram"}.get(str(err["loc"][0]), str(err["loc"][0]))
        raise InvalidInput(f"{field}: {err['msg']}", details={field: [err["msg"]]}) from exc
    return parsed.model_dump(mode="json", exclude={"draft"})


def _checkpoint(team: Team, ref: str, field: str) -> Checkpoint:
    """One of the team's checkpoints by reference, errors naming ``field``."""
    try:
        return resolve_checkpoint(team=team, ref=ref)
    except InvalidInput as exc:
        raise InvalidInput(exc.message.replace("base_model", field, 1),
                           details={field: [ref[:100]]}) from exc


def variant_create(*, actor: Actor, team: Team, checkpoint: str, kind: str, label: str = "",
                   int8: bool = False, ngram: int | None = None,
                   num_speculative_tokens: int | None = None,
                   draft_checkpoint: str | None = None, suite: str | None = None
                   ) -> ServedVariant:
    """Record a served variant of one of the team's checkpoints, with its lineage edges
    (source checkpoint, and draft checkpoint, to the variant); with ``suite``, evaluate it
    there at once: one eval run per entry, serving the source checkpoint with the variant's
    settings (``serving`` in the run's config), linked to the variant in lineage."""
    source = _checkpoint(team, checkpoint, "checkpoint")
    draft = None if draft_checkpoint is None else _checkpoint(team, draft_checkpoint,
                                                              "draft_checkpoint")
    serving = _variant_serving(kind, int8=int8, ngram=ngram,
                               num_speculative_tokens=num_speculative_tokens, draft=draft)
    limits.check_text(label, field="label", limit=limits.NAME)
    run_name = source.run.name or str(source.run_id)[:8]
    shown = f"{kind}+int8" if kind != VariantKind.INT8 and serving["int8"] else kind
    label = label or f"{run_name} @ step {source.step} ({shown})"
    suite_obj = None
    if suite is not None:
        suite_obj = EvalSuite.objects.select_related("team", "project").filter(
            team=team, slug=suite).first()
        if suite_obj is None:
            raise InvalidInput(f"suite: team '{team.slug}' has no eval suite '{suite[:64]}'.",
                               details={"suite": [suite[:64]]})
    with transaction.atomic():
        variant = ServedVariant.objects.create(
            team=team, source=source, kind=kind, draft=draft, serving=serving, label=label[:200],
            created_by=actor.user)
        lineage.edge_create(team_id=team.pk, source=source, target=variant, relation="variant")
        if draft is not None:
            lineage.edge_create(team_id=team.pk, source=draft, target=variant, relation="draft")
        if suite_obj is not None:
            run_serving = dict(serving)
            if draft is not None:
                run_serving["draft"] = f"checkpoint:{draft.pk}"
            evaluation = evaluate_variant(actor=actor, suite=suite_obj, label=variant.label,
                                          source=source, serving=run_serving)
            variant.evaluation = evaluation
            variant.save(update_fields=["evaluation"])
            for result in evaluation.results.select_related("run"):
                if result.run is not None:
                    lineage.edge_create(team_id=team.pk, source=variant, target=result.run,
                                        relation="evaluated")
        audit.record(actor=actor, action="evals.variant.create", team_id=team.pk,
                     target_type="served_variant", target_id=str(variant.pk),
                     data={"checkpoint": source.pk, "kind": kind, "serving": serving,
                           "draft": draft.pk if draft else None, "suite": suite})
    return variant


def on_checkpoint_added(checkpoint_id: int) -> None:
    """After a checkpoint commits: evaluate it with the suite its run names (once). A suite
    that is gone or refuses the launch is logged; the checkpoint itself stands."""
    ckpt = Checkpoint.objects.select_related("run").filter(pk=checkpoint_id).first()
    if ckpt is None or ckpt.run.kind != RunKind.TRAIN:
        return
    slug = (ckpt.run.config or {}).get("eval_suite")
    if not slug:
        return
    suite = EvalSuite.objects.select_related("team", "project").filter(
        team_id=ckpt.team_id, slug=slug).first()
    if suite is None:
        log.warning("run %s names eval suite '%s', which team %s no longer has; checkpoint "
                    "%s is not evaluated", ckpt.run_id, slug, ckpt.team_id, ckpt.pk)
        return
    if SuiteEvaluation.objects.filter(suite=suite, checkpoint=ckpt).exists():
        return
    run = ckpt.run
    try:
        evaluate(actor=Actor.system(), suite=suite, subject_kind=SubjectKind.CHECKPOINT,
                 label=f"{run.name or str(run.pk)[:8]} @ step {ckpt.step}",
                 base_model=f"checkpoint:{ckpt.pk}", checkpoint=ckpt, trigger="checkpoint")
    except DomainError as exc:
        log.warning("eval suite '%s' could not evaluate checkpoint %s: %s", slug, ckpt.pk,
                    exc.message)


def on_run_finished(run_id: uuid.UUID) -> None:
    for result in EntryResult.objects.filter(run_id=run_id, status=ResultStatus.PENDING):
        record_result(result_id=result.pk)


def record_result(*, result_id: int) -> EntryResult:
    """Copy a finished eval run's figures into its result row (once): the entry's score,
    mean reward, pass@k, tasks and latency from the run's report, and the CPU/GPU-seconds
    its attempts held. A run that failed, or whose report cannot be read, fails the entry."""
    with transaction.atomic():
        result = EntryResult.objects.select_for_update().select_related("entry").get(
            pk=result_id)
        run = Run.objects.filter(pk=result.run_id).first() if result.run_id else None
        if result.status != ResultStatus.PENDING:
            return result
        if run is None:
            result.status, result.error = ResultStatus.FAILED, "its eval run was deleted"
        elif run.status == RunStatus.SUCCEEDED:
            _copy_report(result, run)
        elif run.status in (RunStatus.FAILED, RunStatus.CANCELED):
            result.status = ResultStatus.FAILED
            result.error = f"eval run {run.status}: {run.error}".strip(": ")[:2000]
        else:
            return result
        if run is not None:
            result.cpu_seconds, result.gpu_seconds = selectors.run_resource_seconds(run)
        result.finished_at = timezone.now()
        result.save()
    return result


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def _copy_report(result: EntryResult, run: Run) -> None:
    try:
        report = objects.read_json(run, run.report_uri)
    except DomainError as exc:
        result.status, result.error = ResultStatus.FAILED, f"report unreadable: {exc.message}"
        return
    raw = report.get("summary")
    summary: dict[str, Any] = raw if isinstance(raw, dict) else {}
    pass_at = {str(k): _number(v) for k, v in (summary.get("pass_at") or {}).items()}
    result.mean_reward = _number(summary.get("mean_reward"))
    result.pass_at = pass_at
    tasks = summary.get("tasks")
    result.tasks = tasks if isinstance(tasks, int) and tasks >= 0 else None
    raw_latency = summary.get("latency_s")
    latency: dict[str, Any] = raw_latency if isinstance(raw_latency, dict) else {}
    result.latency_s = _number(latency.get("mean"))
    metric = result.entry.metric
    result.score = result.mean_reward if metric == "mean_reward" else \
        pass_at.get(metric.removeprefix("pass@"))
    if result.score is None:
        result.status = ResultStatus.FAILED
        result.error = f"the report has no {metric}"
    else:
        result.status = ResultStatus.SUCCEEDED


def refresh(evaluation: SuiteEvaluation) -> None:
    """Record any result whose run finished but was not recorded (its hook failed after
    commit): promotion reads the truth, not a missed notification."""
    for result in evaluation.results.filter(status=ResultStatus.PENDING,
                                            run__status__in=(RunStatus.SUCCEEDED,
                                                             RunStatus.FAILED,
                                                             RunStatus.CANCELED)):
        record_result(result_id=result.pk)


def check_train_launch(team: Team, kind: str, config: dict[str, Any]) -> None:
    """A train run may name only a suite its team has (the launch says so, not the first
    checkpoint)."""
    slug = config.get("eval_suite") if kind == RunKind.TRAIN else None
    if slug and not EvalSuite.objects.filter(team=team, slug=slug).exists():
        raise InvalidInput(f"config.eval_suite: team '{team.slug}' has no eval suite "
                           f"'{slug}' (create it at POST …/evals/suites first).",
                           details={"config.eval_suite": [f"no suite '{slug}'"]})


# --- promotion -------------------------------------------------------------------------------


def promote(*, actor: Actor, checkpoint: Checkpoint, note: str = "") -> Promotion:
    """Promote ``checkpoint``, gated by the suite its run names: refused (409) until that
    suite's latest evaluation of it has finished every entry without a regression against
    the previous version or the baseline. A run that names no suite is not gated."""
    limits.check_text(note, field="note", limit=500)
    gate = selectors.promotion_gate(checkpoint, refresh=refresh)
    if not gate["allowed"]:
        raise Conflict(gate["message"], code=gate["code"], details=gate)
    with transaction.atomic():
        if Promotion.objects.filter(checkpoint=checkpoint).exists():
            raise Conflict(f"Checkpoint {checkpoint.pk} is already promoted.",
                           code="already_promoted")
        try:
            with transaction.atomic():
                promotion = Promotion.objects.create(
                    team_id=checkpoint.team_id, checkpoint=checkpoint,
                    evaluation_id=gate["evaluation"], note=note, promoted_by=actor.user)
        except IntegrityError as exc:  # a concurrent promote won the race
            raise Conflict(f"Checkpoint {checkpoint.pk} is already promoted.",
                           code="already_promoted") from exc
        audit.record(actor=actor, action="checkpoint.promote", team_id=checkpoint.team_id,
                     target_type="checkpoint", target_id=checkpoint.pk,
                     data={"suite": gate["suite"], "evaluation": gate["evaluation"],
                           "verdict": gate["verdict"]})
    return promotion
