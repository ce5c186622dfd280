"""One environment version's page: its QC report and eval reports, the runs of it, and the
forms that launch QC and eval runs of it (a POST to the page, ``op`` names the run kind;
members and up). It lives with runs, which pin environments, so the environments app never
imports runs; the report presenters stay in ``apps.environments.views``. Launches go through
``run_launch``, the API's own path, so the page refuses what the API refuses."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from apps.core.actor import Actor
from apps.core.exceptions import DomainError, InvalidInput
from apps.environments import selectors as environment_selectors
from apps.environments import services as environment_services
from apps.environments.models import Environment, EnvironmentVersion
from apps.environments.views import (
    environment_context,
    environment_or_404,
    eval_view,
    qc_view,
    spec_summary,
)
from apps.runs import objects, selectors
from apps.runs.launch import run_launch
from apps.runs.models import Pool, Run
from apps.teams.models import Membership, Role, Team, role_at_least
from apps.teams.pages import team_page

EVAL_REPORTS_SHOWN = 10  # full reports read from the object store per page view
VERSION_RUNS_SHOWN = 20


@team_page(write=Role.VIEWER)
@require_http_methods(["GET", "POST"])
def version_detail(request: HttpRequest, team_obj: Team, membership: Membership,
                   environment: str, version: str) -> HttpResponse:
    """GET shows the version; POST launches a run of it: ``op`` = ``qc`` or ``eval``."""
    env = environment_or_404(team_obj, environment)
    obj = environment_selectors.version_lookup(env, version)
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
    context = environment_context(
        request, team_obj, membership, env=env, version=obj, spec=spec_summary(obj.spec),
        spec_json=json.dumps(obj.spec, indent=2, sort_keys=True)[:200_000],
        blocked_reason=environment_services.blocked_reason(obj), qc=qc_view(obj.qc_report),
        evals=_eval_reports(obj), runs=selectors.environment_version_runs(obj, VERSION_RUNS_SHOWN),
        pools=Pool.values,
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
    rows = []
    for run in selectors.environment_eval_runs(version, EVAL_REPORTS_SHOWN):
        try:
            report = objects.read_json(run, run.report_uri)
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
