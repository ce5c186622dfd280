"""A dataset's page: its versions and manifests, the diff of its two newest versions, the
batches under review that would become its versions, and a server-rendered lineage graph
that names the runs and checkpoints around it. It lives in review, the app above datasets
and runs, so neither of those imports the other's pages."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.safestring import mark_safe

from apps.datasets import lineage_svg
from apps.datasets import selectors as dataset_selectors
from apps.datasets.manifests import present
from apps.datasets.models import Dataset, DatasetVersion
from apps.datasets.views import (
    AUTO_DIFF_RECORDS,
    VERSIONS_SHOWN,
    dataset_context,
    dataset_or_404,
    diff_context,
)
from apps.lineage import selectors as lineage_selectors
from apps.review import selectors
from apps.runs import selectors as run_selectors
from apps.teams.models import Membership, Team
from apps.teams.pages import team_page

LINEAGE_VERSIONS = 12  # versions whose neighbourhood the graph shows
LINEAGE_DEPTH = 3


@team_page()
def dataset_detail(request: HttpRequest, team_obj: Team, membership: Membership,
        dataset: str) -> HttpResponse:
    obj = dataset_or_404(team_obj, dataset)
    versions = list(dataset_selectors.versions_of(obj)[:VERSIONS_SHOWN])
    rows = [{"version": v, "manifest": present(v.manifest)} for v in versions]
    batches = list(selectors.with_counts(obj.batches.all()).order_by("-created_at")[:50])
    diff = None
    if len(versions) >= 2 and max(v.record_count for v in versions[:2]) <= AUTO_DIFF_RECORDS:
        diff = diff_context(team_obj, obj, versions[0], versions[1], keys=None)
    context = dataset_context(
        request, team_obj, membership, dataset=obj, versions=rows, batches=batches,
        history=dataset_selectors.current_history(obj), diff=diff,
        lineage=mark_safe(_lineage_svg(team_obj, obj, versions)),  # noqa: S308 (escaped)
    )
    return render(request, "datasets/detail.html", context)


def _lineage_svg(team: Any, dataset: Dataset, versions: list[DatasetVersion]) -> str:
    found_nodes: set[tuple[str, str]] = set()
    found_edges: dict[tuple, lineage_svg.Edge] = {}
    for version in versions[:LINEAGE_VERSIONS]:
        graph = lineage_selectors.graph(team_id=team.pk, artifact_type="dataset_version",
                                        artifact_id=version.digest, depth=LINEAGE_DEPTH)
        found_nodes |= {(n["type"], n["id"]) for n in graph["nodes"]}
        for e in graph["edges"]:
            edge = lineage_svg.Edge((e["source"]["type"], e["source"]["id"]),
                                    (e["target"]["type"], e["target"]["id"]), e["relation"])
            found_edges[(edge.source, edge.target, edge.relation)] = edge
    nodes = _label_nodes(team, dataset, found_nodes)
    return lineage_svg.render(nodes, list(found_edges.values()),
                              title=f"Lineage of {dataset.slug}")


def _label_nodes(team: Any, dataset: Dataset, keys: set[tuple[str, str]]) -> list:
    by_type: dict[str, set[str]] = {}
    for kind, ident in keys:
        by_type.setdefault(kind, set()).add(ident)
    versions: dict[str, DatasetVersion] = {}
    for v in (DatasetVersion.objects.filter(team=team, digest__in=by_type.get(
            "dataset_version", set())).select_related("dataset").order_by("-id")):
        if v.digest not in versions or v.dataset_id == dataset.pk:
            versions[v.digest] = v
    run_ids = [i for i in by_type.get("run", set()) if _is_uuid(i)]
    runs = run_selectors.runs_by_id(team, run_ids)
    ckpt_ids = [int(i) for i in by_type.get("checkpoint", set()) if i.isdigit()]
    ckpts = run_selectors.checkpoints_by_id(team, ckpt_ids)
    nodes = []
    for kind, ident in keys:
        label, sub, href, current = ident[:12], kind.replace("_", " "), "", False
        if kind == "dataset_version" and ident in versions:
            v = versions[ident]
            label = f"{v.dataset.slug} v{v.number}"
            sub = f"{v.record_count} records · {ident[:10]}"
            href = reverse("dataset-page", args=[team.slug, v.dataset.slug])
            current = v.pk == dataset.current_version_id
        elif kind == "run" and ident in runs:
            run = runs[ident]
            label = run.name or f"{run.kind} run"
            sub = f"{run.kind} · {run.status}"
            href = reverse("run-page", args=[team.slug, ident])
        elif kind == "checkpoint" and ident in ckpts:
            label = f"checkpoint step {ckpts[ident].step}"
        nodes.append(lineage_svg.Node((kind, ident), label, sub, href, current))
    return nodes


def _is_uuid(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
