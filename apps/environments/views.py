"""Environment pages: the team's environments; one environment with its versions (spec
summary, digest, QC status, why it is blocked); one version with its QC report (checks,
quarantined tasks and their reasons, flags) and eval reports, and forms that launch QC and
eval runs of it (a POST to the page, ``op`` names the run kind; members and up).

Reports are rendered here from their JSON (the engine is not imported); every value goes
through the template engine's escaping. Launches go through ``run_launch``, the API's own
path, so the page refuses what the API refuses."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, OuterRef, Subquery
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from apps.core.actor import Actor
from apps.core.exceptions import DomainError, InvalidInput
from apps.core.pages import page_context, team_for_page
from apps.environments import selectors, services
from apps.environments.models import Environment, EnvironmentVersion
from apps.runs import objects as run_objects
from apps.runs.launch import run_launch
from apps.runs.models import Pool, Run, RunStatus
from apps.teams.models import Role, role_at_least

VERSIONS_SHOWN = 100
EVAL_REPORTS_SHOWN = 10  # full reports read from the object store per page view
VERSION_RUNS_SHOWN = 20
QUARANTINE_ROWS = 500  # a pathological report still renders in bounded time
FLAG_IDS_SHOWN = 12


def _context(request: HttpRequest, team: Any, membership: Any, **extra: Any) -> dict[str, Any]:
    return page_context(request, team, membership, section="environments", **extra)


def _environment(team: Any, slug: str) -> Environment:
    env = Environment.objects.select_related("project").filter(team=team, slug=slug).first()
    if env is None:
        raise Http404("No such environment.")
    return env


# --- pure presenters ----------------------------------------------------------------------


def spec_summary(spec: Any) -> dict[str, Any]:
    """What a version is, in a line: source, name/module, task count, rubric, interaction.
    Defensive: specs stored before validation existed may have any shape."""
    doc = spec if isinstance(spec, dict) else {}
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    source = str(env.get("source") or "unknown")
    out: dict[str, Any] = {"source": source, "label": source, "description":
                           str(doc.get("description") or ""), "tasks": None,
                           "components": [], "mode": "", "params": {}}
    if source == "builtin":
        out["label"] = f"built-in {env.get('name', '?')}"
        out["params"] = env.get("params") if isinstance(env.get("params"), dict) else {}
    elif source == "verifiers":
        out["label"] = f"verifiers {env.get('module', '?')}"
        out["params"] = env.get("args") if isinstance(env.get("args"), dict) else {}
    elif source == "tasks":
        tasks = env.get("tasks")
        dataset = env.get("dataset") if isinstance(env.get("dataset"), dict) else None
        if isinstance(tasks, list):
            out["tasks"] = len(tasks)
            out["label"] = f"{len(tasks)} uploaded task{'s' if len(tasks) != 1 else ''}"
        elif dataset:
            out["label"] = f"tasks from dataset {dataset.get('dataset')} v{dataset.get('version')}"
        rubric = env.get("rubric") if isinstance(env.get("rubric"), dict) else {}
        out["components"] = [
            {"name": c.get("name"), "checker": c.get("checker"), "weight": c.get("weight", 1.0)}
            for c in rubric.get("components", []) if isinstance(c, dict)]
        interaction = env.get("interaction") if isinstance(env.get("interaction"), dict) else {}
        out["mode"] = str(interaction.get("mode") or "")
    return out


def qc_view(report: Any) -> dict[str, Any] | None:
    """The stored QC report (``crucible.qc/1`` less per-task rows) shaped for the template;
    None when QC has not reported."""
    if not isinstance(report, dict) or not report:
        return None
    summary = report.get("summary") if isinstance(report.get("summary"), dict) else {}
    quarantined = [q for q in report.get("quarantined") or [] if isinstance(q, dict)]
    flags = []
    for f in report.get("flags") or []:
        if not isinstance(f, dict):
            continue
        ids = [str(i) for i in f.get("task_ids") or []]
        flags.append({"kind": f.get("kind", ""), "task_ids": ids[:FLAG_IDS_SHOWN],
                      "more": max(0, len(ids) - FLAG_IDS_SHOWN), "detail": f.get("detail", ""),
                      "similarity": f.get("similarity")})
    usable = summary.get("usable_tasks") if isinstance(summary.get("usable_tasks"), dict) else {}
    return {
        "passed": bool(report.get("passed")) and not report.get("blocked"),
        "block_reasons": [str(r) for r in report.get("block_reasons") or []],
        "summary": summary, "usable": usable,
        "by_reason": sorted((summary.get("by_reason") or {}).items()),
        "flag_counts": sorted((summary.get("flags") or {}).items()),
        "checks": [c for c in report.get("environment_checks") or [] if isinstance(c, dict)],
        "quarantined": [{"task_id": q.get("task_id"),
                         "reasons": [r for r in q.get("reasons") or [] if isinstance(r, dict)]}
                        for q in quarantined[:QUARANTINE_ROWS]],
        "quarantined_more": max(0, len(quarantined) - QUARANTINE_ROWS),
        "flags": flags, "timings": report.get("timings") or {},
        "config": report.get("config") or {},
        "run": report.get("run"), "report_uri": report.get("report_uri"),
        "started_at": report.get("started_at"), "finished_at": report.get("finished_at"),
    }


def _group_rows(groups: Any, ks: list[str]) -> list[dict[str, Any]]:
    if not isinstance(groups, dict):
        return []
    return [{"name": name, "tasks": g.get("tasks"), "mean_reward": g.get("mean_reward"),
             "pass_at": [(g.get("pass_at") or {}).get(k) for k in ks]}
            for name, g in groups.items() if isinstance(g, dict)]


def eval_view(report: Any) -> dict[str, Any]:
    """A ``crucible.eval/1`` report shaped for the template (pass@k in k order)."""
    report = report if isinstance(report, dict) else {}
    summary = report.get("summary") if isinstance(report.get("summary"), dict) else {}
    ks = [str(k) for k in report.get("k") or sorted((summary.get("pass_at") or {}), key=str)]
    policy = report.get("policy") if isinstance(report.get("policy"), dict) else {}
    latency = summary.get("latency_s") if isinstance(summary.get("latency_s"), dict) else {}
    components = report.get("components") if isinstance(report.get("components"), dict) else {}
    return {
        "ks": ks, "policy": policy.get("name", ""), "sampling": policy.get("sampling") or {},
        "split": report.get("split"), "samples_per_task": report.get("samples_per_task"),
        "summary": summary, "pass_at": [(summary.get("pass_at") or {}).get(k) for k in ks],
        "latency_mean": latency.get("mean"), "by_difficulty":
        _group_rows(report.get("by_difficulty"), ks), "by_topic":
        _group_rows(report.get("by_topic"), ks),
        "components": [{"name": n, "weight": c.get("weight"), "mean": c.get("mean")}
                       for n, c in components.items() if isinstance(c, dict)],
        "error": report.get("error"),
    }


# --- pages --------------------------------------------------------------------------------


@login_required
def environment_list(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    latest = EnvironmentVersion.objects.filter(environment=OuterRef("pk")).order_by("-number")
    envs = list(Environment.objects.filter(team=team_obj).select_related("project")
                .annotate(n_versions=Count("versions"),
                          latest_id=Subquery(latest.values("pk")[:1]))
                .order_by("slug"))
    versions = EnvironmentVersion.objects.in_bulk([e.latest_id for e in envs if e.latest_id])
    rows = [{"env": e, "latest": versions.get(e.latest_id),
             "ref": f"v{versions[e.latest_id].number}" if e.latest_id in versions else "",
             "blocked_reason": services.blocked_reason(versions[e.latest_id])
             if e.latest_id in versions else ""} for e in envs]
    return render(request, "environments/list.html",
                  _context(request, team_obj, membership, rows=rows))


@login_required
def environment_detail(request: HttpRequest, team: str, environment: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    env = _environment(team_obj, environment)
    versions = list(env.versions.select_related("created_by").order_by("-number")
                    [:VERSIONS_SHOWN])
    rows = [{"version": v, "ref": f"v{v.number}", "spec": spec_summary(v.spec),
             "blocked_reason": services.blocked_reason(v)} for v in versions]
    return render(request, "environments/detail.html",
                  _context(request, team_obj, membership, env=env, versions=rows))


@login_required
@require_http_methods(["GET", "POST"])
def version_detail(request: HttpRequest, team: str, environment: str, version: str
                   ) -> HttpResponse:
    """GET shows the version; POST launches a run of it: ``op`` = ``qc`` or ``eval``."""
    team_obj, membership = team_for_page(request, team)
    env = _environment(team_obj, environment)
    obj = selectors.version_lookup(env, version)
    if obj is None:
        raise Http404(f"Environment '{env.slug}' has no version '{version}'.")
    form_errors: dict[str, Any] = {}
    status = 200
    if request.method == "POST":
        if not role_at_least(membership.role, Role.MEMBER):
            form_errors = {"op": f"Launching runs needs the member role; you are "
                                 f"{membership.role}."}
            status = 403
        else:
            op = request.POST.get("op", "")
            if op not in ("qc", "eval"):
                form_errors, status = {"op": f"Unknown operation '{op[:40]}'; use qc or eval."}, 400
            else:
                try:
                    run = _launch(request, team_obj, env, obj, op)
                except DomainError as exc:
                    form_errors = {"op": op, "message": exc.message,
                                   "fields": _field_errors(exc)}
                    status = exc.status_code
                else:
                    label = "QC" if op == "qc" else "Evaluation"
                    messages.success(request, f"{label} run {str(run.pk)[:8]} queued for "
                                              f"{env.slug} v{obj.number}; it starts when a "
                                              f"worker of its pool is free.")
                    return redirect("environment-version-page", team=team_obj.slug,
                                    environment=env.slug, version=f"v{obj.number}")
    context = _context(
        request, team_obj, membership, env=env, version=obj, spec=spec_summary(obj.spec),
        spec_json=json.dumps(obj.spec, indent=2, sort_keys=True)[:200_000],
        blocked_reason=services.blocked_reason(obj), qc=qc_view(obj.qc_report),
        evals=_eval_reports(obj), runs=_version_runs(obj), pools=Pool.values,
        form_errors=form_errors, posted=request.POST if request.method == "POST" else {},
    )
    return render(request, "environments/version.html", context, status=status)


def _launch(request: HttpRequest, team: Any, env: Environment, version: EnvironmentVersion,
            op: str) -> Run:
    post = request.POST
    pool = post.get("pool") or None
    config: dict[str, Any] = {}
    base_model = None
    if op == "qc":
        repeats = _int(post.get("repeats"), "repeats")
        if repeats is not None:
            config = {"qc": {"repeats": repeats}}
    else:
        base_url, model = (post.get("base_url") or "").strip(), (post.get("model") or "").strip()
        if base_url or model:
            config["policy"] = {"kind": "endpoint", "base_url": base_url, "model": model}
        else:
            base_model = (post.get("base_model") or "").strip() or None
        for key in ("samples_per_task", "limit"):
            value = _int(post.get(key), key)
            if value is not None:
                config[key] = value
        k_text = (post.get("k") or "").strip()
        if k_text:
            config["k"] = [_int(part, "k") for part in k_text.replace(" ", "").split(",")]
    launched = run_launch(actor=Actor.of_user(request.user), team=team, document={
        "project": env.project.slug, "kind": op, "config": config,
        "name": (post.get("name") or "").strip()[:200], "pool": pool,
        "base_model": base_model, "environment": f"{env.slug}@v{version.number}"})
    return launched.run


def _int(raw: str | None, field: str) -> int | None:
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise InvalidInput(f"{field} must be a whole number; got '{raw[:20]}'.",
                           details={field: ["a whole number"]}) from None


def _field_errors(exc: DomainError) -> dict[str, str]:
    """The error details keyed by form field (``config.k`` -> ``k``)."""
    details = getattr(exc, "details", None) or {}
    out: dict[str, str] = {}
    for key, value in details.items():
        field = str(key).removeprefix("config.").split(".")[0]
        if field == "policy":
            field = "base_url"
        text = "; ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        out[field] = f"{out[field]}; {text}" if field in out else text
    return out


def _eval_reports(version: EnvironmentVersion) -> list[dict[str, Any]]:
    """Succeeded eval runs of the version, newest first, each with its full report."""
    runs = (Run.objects.filter(team_id=version.team_id, kind="eval",
                               environment_pins__environment_version=version,
                               status=RunStatus.SUCCEEDED)
            .exclude(report_uri="").select_related("base_checkpoint__run")
            .order_by("-created_at")[:EVAL_REPORTS_SHOWN])
    rows = []
    for run in runs:
        try:
            report = run_objects.read_json(run, run.report_uri)
        except DomainError as exc:
            report = {"error": f"report unreadable: {exc.message}"}
        rows.append({"run": run, "report": eval_view(report),
                     "evaluated": _evaluated(run, report)})
    return rows


def _evaluated(run: Run, report: dict[str, Any]) -> str:
    """What an eval run scored, in people's terms: the served policy's own name (a local
    ``policy@http://127.0.0.1:…`` endpoint says nothing), else its model source."""
    config = run.config if isinstance(run.config, dict) else {}
    policy = config.get("policy") if isinstance(config.get("policy"), dict) else None
    if policy:  # an outside endpoint the user named
        return f"endpoint {policy.get('model') or ''} at {policy.get('base_url') or '?'}".strip()
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    label = (f"the model at {model.get('path')}" if model.get("source") == "path"
             else "the built-in tiny preset model (untrained)")
    named = report.get("policy") if isinstance(report.get("policy"), dict) else {}
    name = str(named.get("name") or "")
    # The worker serves the model itself as "policy@http://127.0.0.1:<port>": not a name.
    if name and name != "policy" and not name.startswith("policy@"):
        label += f" ({name})"
    return label


def _version_runs(version: EnvironmentVersion) -> list[Run]:
    return list(Run.objects.filter(team_id=version.team_id, kind__in=("qc", "eval"),
                                   environment_pins__environment_version=version)
                .select_related("created_by").order_by("-created_at")[:VERSION_RUNS_SHOWN])
