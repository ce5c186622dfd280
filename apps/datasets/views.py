"""Dataset pages: the team's datasets; the diff of two versions, records, upload and
rollback (with confirmation). A dataset's own page, which shows its review batches and a
lineage graph naming runs, is ``apps.review.dataset_pages`` (above datasets and runs)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.datasets import selectors, services
from apps.datasets.models import Dataset, DatasetVersion
from apps.teams.models import Membership, Role, Team, role_at_least
from apps.teams.pages import page_context, team_page

VERSIONS_SHOWN = 100
#: The page diffs its two newest versions on load only when both are this small; larger
#: ones are diffed on request (the form), so a big dataset's page stays fast.
AUTO_DIFF_RECORDS = 20_000


def dataset_context(request: HttpRequest, team: Any, membership: Any,
                    **extra: Any) -> dict[str, Any]:
    """The layout's context with the datasets section highlighted."""
    return page_context(request, team, membership, section="datasets", **extra)


def dataset_or_404(team: Any, slug: str) -> Dataset:
    """The team's dataset, or the page 404 a non-member also gets."""
    dataset = (Dataset.objects.select_related("project", "current_version")
               .filter(team=team, slug=slug).first())
    if dataset is None:
        raise Http404("No such dataset.")
    return dataset


@team_page()
def dataset_list(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    rows = selectors.datasets_overview(team_obj)
    return render(request, "datasets/list.html",
                  dataset_context(request, team_obj, membership, datasets=rows))


def _version(dataset: Dataset, ref: str) -> DatasetVersion:
    version = selectors.version_by_digest(dataset=dataset, digest=ref) if ref else None
    if version is None:
        raise Http404(f"Dataset '{dataset.slug}' has no version '{ref}'.")
    return version


def diff_context(team: Any, dataset: Dataset, version: DatasetVersion,
                  base: DatasetVersion | None, *, keys: tuple[str, ...] | None) -> dict:
    kwargs = {} if keys is None else {"keys": keys}
    return selectors.diff_versions(base=base, version=version, limit=50, **kwargs)


@team_page()
def dataset_diff(request: HttpRequest, team_obj: Team, membership: Membership,
        dataset: str) -> HttpResponse:
    """``?a=<old>&b=<new>`` (digests or v<number>): the diff, as a partial for htmx."""
    obj = dataset_or_404(team_obj, dataset)
    newest = obj.versions.order_by("-number").first()
    b = _version(obj, request.GET["b"]) if request.GET.get("b") else newest
    if b is None:
        diff = None
    else:
        a = (_version(obj, request.GET["a"]) if request.GET.get("a")
             else selectors.default_base(b))
        raw_key = request.GET.get("key")
        keys = None if raw_key is None else tuple(k for k in [raw_key.strip()] if k)
        diff = diff_context(team_obj, obj, b, a, keys=keys)
    context = dataset_context(request, team_obj, membership, dataset=obj, diff=diff,
                       versions=[{"version": v} for v in selectors.versions_of(obj)])
    template = "datasets/_diff.html" if request.htmx else "datasets/diff.html"
    return render(request, template, context)


RECORDS_PER_PAGE = 25


@team_page()
def dataset_records(request: HttpRequest, team_obj: Team, membership: Membership,
        dataset: str) -> HttpResponse:
    """``?v=<version>&q=<text>&field=<field>&page=<n>``: a page of a version's records,
    searchable in one field or all, with a column per field (an htmx partial or a page)."""
    obj = dataset_or_404(team_obj, dataset)
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
    context = dataset_context(request, team_obj, membership, dataset=obj, version=version,
                       found=found, q=q, field=field, page_number=number, pages=pages,
                       versions=[{"version": v} for v in selectors.versions_of(obj)],
                       first=(number - 1) * RECORDS_PER_PAGE)
    template = "datasets/_records.html" if request.htmx else "datasets/records.html"
    return render(request, template, context)


@team_page(write=Role.VIEWER)
@require_http_methods(["GET", "POST"])
def dataset_upload(request: HttpRequest, team_obj: Team, membership: Membership,
        dataset: str) -> HttpResponse:
    """GET: the upload form on a page of its own; POST: a new version from the chosen JSONL
    file (members and up), through the same service as the API (same checks, same content
    addressing)."""
    from apps.datasets import records as rec

    obj = dataset_or_404(team_obj, dataset)
    if request.method == "GET":
        return render(request, "datasets/upload.html",
                      dataset_context(request, team_obj, membership, dataset=obj))
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


@team_page(write=Role.VIEWER)
@require_http_methods(["GET", "POST"])
def dataset_rollback(request: HttpRequest, team_obj: Team, membership: Membership,
        dataset: str) -> HttpResponse:
    """GET: confirm rolling back to ``?to=<version>``; POST: do it (members and up)."""
    obj = dataset_or_404(team_obj, dataset)
    ref = request.POST.get("to") if request.method == "POST" else request.GET.get("to")
    current = obj.current_version
    earlier = [v for v in selectors.versions_of(obj) if current is None
               or v.number < current.number]
    target = _version(obj, ref) if ref else None
    error = ""
    if request.method == "POST":
        if not role_at_least(membership.role, Role.MEMBER):
            return render(request, "datasets/rollback.html", dataset_context(
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
    return render(request, "datasets/rollback.html", dataset_context(
        request, team_obj, membership, dataset=obj, target=target, earlier=earlier,
        error=error), status=status)


# --- lineage ------------------------------------------------------------------------------
