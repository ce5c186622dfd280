"""Dataset pages: the team's datasets; one dataset with its versions, manifests, batches,
diff of two versions, rollback (with confirmation) and a server-rendered lineage graph."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_http_methods

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.core.pages import page_context, team_for_page
from apps.datasets import lineage_svg, selectors, services
from apps.datasets.manifests import present
from apps.datasets.models import Dataset, DatasetVersion
from apps.lineage import selectors as lineage_selectors
from apps.review.selectors import with_counts
from apps.runs.models import Checkpoint, Run
from apps.teams.models import Role, role_at_least

LINEAGE_VERSIONS = 12  # versions whose neighbourhood the graph shows
LINEAGE_DEPTH = 3
VERSIONS_SHOWN = 100
#: The page diffs its two newest versions on load only when both are this small; larger
#: ones are diffed on request (the form), so a big dataset's page stays fast.
AUTO_DIFF_RECORDS = 20_000


def _context(request: HttpRequest, team: Any, membership: Any, **extra: Any) -> dict[str, Any]:
    return page_context(request, team, membership, section="datasets", **extra)


def _dataset(team: Any, slug: str) -> Dataset:
    dataset = (Dataset.objects.select_related("project", "current_version")
               .filter(team=team, slug=slug).first())
    if dataset is None:
        raise Http404("No such dataset.")
    return dataset


@login_required
def dataset_list(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    rows = selectors.datasets_overview(team_obj)
    return render(request, "datasets/list.html",
                  _context(request, team_obj, membership, datasets=rows))


@login_required
def dataset_detail(request: HttpRequest, team: str, dataset: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    obj = _dataset(team_obj, dataset)
    versions = list(selectors.versions_of(obj)[:VERSIONS_SHOWN])
    rows = [{"version": v, "manifest": present(v.manifest)} for v in versions]
    batches = list(with_counts(obj.batches.all()).order_by("-created_at")[:50])
    diff = None
    if len(versions) >= 2 and max(v.record_count for v in versions[:2]) <= AUTO_DIFF_RECORDS:
        diff = _diff_context(team_obj, obj, versions[0], versions[1], keys=None)
    context = _context(
        request, team_obj, membership, dataset=obj, versions=rows, batches=batches,
        history=selectors.current_history(obj), diff=diff,
        lineage=mark_safe(_lineage_svg(team_obj, obj, versions)),  # noqa: S308 (escaped)
    )
    return render(request, "datasets/detail.html", context)


def _version(dataset: Dataset, ref: str) -> DatasetVersion:
    version = selectors.version_by_digest(dataset=dataset, digest=ref) if ref else None
    if version is None:
        raise Http404(f"Dataset '{dataset.slug}' has no version '{ref}'.")
    return version


def _diff_context(team: Any, dataset: Dataset, version: DatasetVersion,
                  base: DatasetVersion | None, *, keys: tuple[str, ...] | None) -> dict:
    kwargs = {} if keys is None else {"keys": keys}
    return selectors.diff_versions(base=base, version=version, limit=50, **kwargs)


@login_required
def dataset_diff(request: HttpRequest, team: str, dataset: str) -> HttpResponse:
    """``?a=<old>&b=<new>`` (digests or v<number>): the diff, as a partial for htmx."""
    team_obj, membership = team_for_page(request, team)
    obj = _dataset(team_obj, dataset)
    newest = obj.versions.order_by("-number").first()
    b = _version(obj, request.GET["b"]) if request.GET.get("b") else newest
    if b is None:
        diff = None
    else:
        a = (_version(obj, request.GET["a"]) if request.GET.get("a")
             else selectors.default_base(b))
        raw_key = request.GET.get("key")
        keys = None if raw_key is None else tuple(k for k in [raw_key.strip()] if k)
        diff = _diff_context(team_obj, obj, b, a, keys=keys)
    context = _context(request, team_obj, membership, dataset=obj, diff=diff,
                       versions=[{"version": v} for v in selectors.versions_of(obj)])
    template = "datasets/_diff.html" if request.htmx else "datasets/diff.html"
    return render(request, template, context)


RECORDS_PER_PAGE = 25


@login_required
def dataset_records(request: HttpRequest, team: str, dataset: str) -> HttpResponse:
    """``?v=<version>&q=<text>&field=<field>&page=<n>``: a page of a version's records,
    searchable in one field or all, with a column per field (an htmx partial or a page)."""
    team_obj, membership = team_for_page(request, team)
    obj = _dataset(team_obj, dataset)
    ref = request.GET.get("v") or (f"v{obj.current_version.number}" if obj.current_version
                                   else "")
    version = _version(obj, ref) if ref else None
    q = (request.GET.get("q") or "").strip()[:200]
    field = (request.GET.get("field") or "")[:200]
    try:
        number = max(1, min(10**6, int(request.GET.get("page") or 1)))
    except ValueError:
        number = 1
    found = None
    if version is not None:
        found = selectors.search_records(version, q=q, field=field,
                                         offset=(number - 1) * RECORDS_PER_PAGE,
                                         limit=RECORDS_PER_PAGE)
    pages = max(1, -(-found.matched // RECORDS_PER_PAGE)) if found else 1
    context = _context(request, team_obj, membership, dataset=obj, version=version,
                       found=found, q=q, field=field, page_number=number, pages=pages,
                       versions=[{"version": v} for v in selectors.versions_of(obj)],
                       first=(number - 1) * RECORDS_PER_PAGE)
    template = "datasets/_records.html" if request.htmx else "datasets/records.html"
    return render(request, template, context)


@login_required
@require_http_methods(["GET", "POST"])
def dataset_upload(request: HttpRequest, team: str, dataset: str) -> HttpResponse:
    """GET: the upload form on a page of its own; POST: a new version from the chosen JSONL
    file (members and up), through the same service as the API (same checks, same content
    addressing)."""
    from apps.datasets import records as rec

    team_obj, membership = team_for_page(request, team)
    obj = _dataset(team_obj, dataset)
    if request.method == "GET":
        return render(request, "datasets/upload.html",
                      _context(request, team_obj, membership, dataset=obj))
    if not role_at_least(membership.role, Role.MEMBER):
        messages.error(request, f"Uploading needs the member role; you are {membership.role}.")
        return redirect("dataset-page", team=team_obj.slug, dataset=obj.slug)
    upload = request.FILES.get("file")
    if upload is None:
        messages.error(request, "Choose a JSONL file (one JSON object per line) to upload.")
        return redirect(reverse("dataset-page", args=[team_obj.slug, obj.slug]) + "#upload-h")
    try:
        version, created = services.version_create(
            actor=Actor.of_user(request.user), dataset=obj, records=rec.parse_jsonl(upload),
            message=(request.POST.get("message") or "")[:500],
            set_current=request.POST.get("set_current") == "1")
    except DomainError as exc:
        messages.error(request, f"{upload.name}: {exc.message}")
        return redirect(reverse("dataset-page", args=[team_obj.slug, obj.slug]) + "#upload-h")
    if created:
        messages.success(request, f"Uploaded {upload.name} as v{version.number} "
                                  f"({version.record_count} records).")
    else:
        messages.success(request, f"{upload.name} holds the same records as v{version.number};"
                                  " no new version was made.")
    return redirect(reverse("dataset-page", args=[team_obj.slug, obj.slug]) + f"#v{version.number}")


@login_required
@require_http_methods(["GET", "POST"])
def dataset_rollback(request: HttpRequest, team: str, dataset: str) -> HttpResponse:
    """GET: confirm rolling back to ``?to=<version>``; POST: do it (members and up)."""
    team_obj, membership = team_for_page(request, team)
    obj = _dataset(team_obj, dataset)
    ref = request.POST.get("to") if request.method == "POST" else request.GET.get("to")
    current = obj.current_version
    earlier = [v for v in selectors.versions_of(obj) if current is None
               or v.number < current.number]
    target = _version(obj, ref) if ref else None
    error = ""
    if request.method == "POST":
        if not role_at_least(membership.role, Role.MEMBER):
            return render(request, "datasets/rollback.html", _context(
                request, team_obj, membership, dataset=obj, target=target, earlier=earlier,
                error=f"Rolling back needs the member role; you are {membership.role}.",
            ), status=403)
        if target is None:
            error = "Choose the version to roll back to."
        else:
            try:
                _, previous = services.rollback(
                    actor=Actor.of_user(request.user), dataset=obj, version=target,
                    reason=request.POST.get("reason", "")[:500])
            except DomainError as exc:
                error = exc.message
            else:
                frm = f"v{previous.number}" if previous else "no version"
                messages.success(request, f"Rolled back {obj.slug} from {frm} to "
                                          f"v{target.number}.")
                return redirect("dataset-page", team=team_obj.slug, dataset=obj.slug)
    status = 400 if error else 200
    return render(request, "datasets/rollback.html", _context(
        request, team_obj, membership, dataset=obj, target=target, earlier=earlier,
        error=error), status=status)


# --- lineage ------------------------------------------------------------------------------


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
    runs = {str(r.pk): r for r in Run.objects.filter(team=team, pk__in=run_ids)}
    ckpt_ids = [int(i) for i in by_type.get("checkpoint", set()) if i.isdigit()]
    ckpts = {str(c.pk): c for c in Checkpoint.objects.filter(run__team=team, pk__in=ckpt_ids)}
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
