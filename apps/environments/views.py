"""Environment pages: the team's environments; one environment with its versions (spec
summary, digest, QC status, why it is blocked); and the presenters of a version's QC report
(checks, quarantined tasks and their reasons, flags) and eval reports that the version page
(``apps.runs.environment_pages``, beside the runs it launches) renders.

Reports are rendered from their JSON (the engine is not imported); every value goes through
the template engine's escaping."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from apps.environments import selectors, services
from apps.environments.models import Environment
from apps.teams.models import Membership, Team
from apps.teams.pages import page_context, team_page

VERSIONS_SHOWN = 100
QUARANTINE_ROWS = 500  # a pathological report still renders in bounded time
FLAG_IDS_SHOWN = 12


def environment_context(request: HttpRequest, team: Any, membership: Any,
                        **extra: Any) -> dict[str, Any]:
    """The layout's context with the environments section highlighted."""
    return page_context(request, team, membership, section="environments", **extra)


def environment_or_404(team: Any, slug: str) -> Environment:
    """The team's environment, or the page 404 a non-member also gets."""
    env = selectors.environment_by_slug(team, slug)
    if env is None:
        raise Http404("No such environment.")
    return env


# --- pure presenters ----------------------------------------------------------------------


def _task_count(env: dict[str, Any], out: dict[str, Any], kind: str, from_dataset: str) -> None:
    """The label and count of a spec whose tasks are inline or a dataset version's records."""
    tasks = env.get("tasks")
    dataset = env.get("dataset") if isinstance(env.get("dataset"), dict) else None
    if isinstance(tasks, list):
        out["tasks"] = len(tasks)
        out["label"] = f"{len(tasks)} {kind[:-1] if len(tasks) == 1 else kind}"
    elif dataset:
        out["label"] = (f"{from_dataset} from dataset {dataset.get('dataset')} "
                        f"v{dataset.get('version')}")


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
        _task_count(env, out, "uploaded tasks", "tasks")
        rubric = env.get("rubric") if isinstance(env.get("rubric"), dict) else {}
        out["components"] = [
            {"name": c.get("name"), "checker": c.get("checker"), "weight": c.get("weight", 1.0)}
            for c in rubric.get("components", []) if isinstance(c, dict)]
        interaction = env.get("interaction") if isinstance(env.get("interaction"), dict) else {}
        out["mode"] = str(interaction.get("mode") or "")
    elif source == "terminal":
        _task_count(env, out, "terminal tasks", "terminal tasks")
        out["mode"] = "terminal"
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


@team_page()
def environment_list(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    envs, versions = selectors.environments_with_latest(team_obj)
    rows = [{"env": e, "latest": versions.get(e.latest_id),
             "ref": f"v{versions[e.latest_id].number}" if e.latest_id in versions else "",
             "blocked_reason": services.blocked_reason(versions[e.latest_id])
             if e.latest_id in versions else ""} for e in envs]
    return render(request, "environments/list.html",
                  environment_context(request, team_obj, membership, rows=rows))


@team_page()
def environment_detail(request: HttpRequest, team_obj: Team, membership: Membership,
        environment: str) -> HttpResponse:
    env = environment_or_404(team_obj, environment)
    versions = selectors.versions_newest_first(env, VERSIONS_SHOWN)
    rows = [{"version": v, "ref": f"v{v.number}", "spec": spec_summary(v.spec),
             "blocked_reason": services.blocked_reason(v)} for v in versions]
    return render(request, "environments/detail.html",
                  environment_context(request, team_obj, membership, env=env, versions=rows))
