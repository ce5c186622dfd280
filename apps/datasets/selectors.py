"""Reads for datasets, including resolution of references like ``slug@v3``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from django.db.models import Count, Q, QuerySet

from apps.core.exceptions import InvalidInput
from apps.core.models import AuditLog
from apps.core.storage import store
from apps.datasets.diff import DEFAULT_KEYS, diff_records
from apps.datasets.models import Dataset, DatasetVersion
from apps.teams.models import Team


def resolve_version(*, team: Team, ref: str) -> DatasetVersion:
    """``slug`` (current version), ``slug@v3`` (number) or ``slug@<digest prefix ≥ 8>``."""
    slug, _, which = ref.partition("@")
    dataset = Dataset.objects.filter(team=team, slug=slug).first()
    if dataset is None:
        raise InvalidInput(f"Unknown dataset '{slug}' in team '{team.slug}'.",
                           details={"datasets": [f"unknown dataset '{slug}'"]})
    versions = DatasetVersion.objects.filter(dataset=dataset)
    if not which:
        if dataset.current_version_id is None:
            raise InvalidInput(f"Dataset '{slug}' has no versions yet; upload one first.")
        return versions.get(pk=dataset.current_version_id)
    if which[:1] in "vV" and which[1:].isdigit():
        version = versions.filter(number=int(which[1:])).first()
    elif len(which) >= 8 and all(c in "0123456789abcdef" for c in which.lower()):
        matches = list(versions.filter(digest__startswith=which.lower())[:2])
        if len(matches) > 1:
            raise InvalidInput(f"'{ref}' matches several versions; give more of the digest.")
        version = matches[0] if matches else None
    else:
        raise InvalidInput(
            f"Bad dataset reference '{ref}': use slug, slug@v<number> or slug@<digest prefix>.",
            details={"datasets": [f"bad reference '{ref}'"]},
        )
    if version is None:
        raise InvalidInput(f"Dataset '{slug}' has no version '{which}'.",
                           details={"datasets": [f"unknown version '{ref}'"]})
    return version


def version_by_digest(*, dataset: Dataset, digest: str) -> DatasetVersion | None:
    if digest[:1] in "vV" and digest[1:].isdigit():
        return dataset.versions.filter(number=int(digest[1:])).first()
    return dataset.versions.filter(digest=digest).first()


def read_records(version: DatasetVersion, *, offset: int, limit: int) -> list[dict[str, Any]]:
    lines = islice(store().open_lines(version.uri), offset, offset + limit)
    return [json.loads(line) for line in lines]


@dataclass
class RecordPage:
    records: list[dict[str, Any]]
    fields: list[str]
    matched: int  # records matching the search among those scanned
    scanned: int
    complete: bool  # the whole version was scanned (else ``matched`` is a lower bound)


SCAN_LIMIT = 200_000  # lines one search reads at most


def search_records(version: DatasetVersion, *, q: str = "", field: str = "", offset: int = 0,
                   limit: int = 25) -> RecordPage:
    """A page of a version's records, optionally those whose ``field`` (or any field)
    contains ``q`` (case-insensitive, in the value's JSON text). One streaming pass, at most
    SCAN_LIMIT lines; the field list is the union of the top-level fields seen."""
    needle = q.casefold()
    rows: list[dict[str, Any]] = []
    fields: dict[str, None] = {}
    matched = scanned = 0
    complete = True
    for line in store().open_lines(version.uri):
        if scanned >= SCAN_LIMIT:
            complete = False
            break
        scanned += 1
        record = json.loads(line)
        if isinstance(record, dict) and len(fields) < 200:
            fields.update(dict.fromkeys(record))
        if needle:
            if field:
                value = record.get(field) if isinstance(record, dict) else None
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            else:
                text = line.decode("utf-8", "replace")
            if needle not in text.casefold():
                continue
        if offset <= matched < offset + limit:
            rows.append(record)
        matched += 1
    ordered = sorted(fields, key=lambda f: f not in ("id", "uid"))  # ids first, then as read
    return RecordPage(rows, ordered, matched, scanned, complete)


def record_lines(version: DatasetVersion) -> Callable[[], Iterable[bytes]]:
    """A way to read the version's canonical JSON lines (again: each call starts over)."""
    if not version.record_count:
        return lambda: iter(())
    return lambda: store().open_lines(version.uri)


def _lines(version: DatasetVersion | None) -> Callable[[], Iterable[bytes]]:
    if version is None:
        return lambda: iter(())
    return lambda: store().open_lines(version.uri)


def default_base(version: DatasetVersion) -> DatasetVersion | None:
    """What a version is compared with when no base is named: its parent in the same
    dataset, else the version numbered just before it (None for a first version)."""
    parent = version.parents.filter(dataset_id=version.dataset_id).order_by("-number").first()
    if parent is not None:
        return parent
    return (DatasetVersion.objects.filter(dataset_id=version.dataset_id,
                                          number__lt=version.number)
            .order_by("-number").first())


def diff_versions(*, base: DatasetVersion | None, version: DatasetVersion,
                  keys: Sequence[str] = DEFAULT_KEYS, limit: int = 50) -> dict[str, Any]:
    """Records added, removed and changed from ``base`` (None: an empty dataset) to
    ``version``. See apps.datasets.diff for how records are matched."""
    labels = (f"v{base.number}" if base else "the empty dataset", f"v{version.number}")
    result = diff_records(_lines(base), _lines(version), keys=keys, limit=limit,
                          labels=labels)

    def ref(v: DatasetVersion | None) -> dict[str, Any] | None:
        return None if v is None else {"digest": v.digest, "number": v.number}

    return {"base": ref(base), "version": ref(version), **result}


def versions_of(dataset: Dataset) -> QuerySet[DatasetVersion]:
    return dataset.versions.select_related("created_by").prefetch_related("parents") \
        .order_by("-number")


def current_history(dataset: Dataset, limit: int = 20) -> list[AuditLog]:
    """Recent moves of the dataset's current version (rollbacks and explicit sets)."""
    return list(AuditLog.objects.filter(
        team_id=dataset.team_id, target_type="dataset", target_id=dataset.slug,
        action__in=("dataset.rollback", "dataset.current"),
    ).select_related("actor").order_by("-created_at", "-id")[:limit])


def datasets_overview(team: Team) -> QuerySet[Dataset]:
    """The team's datasets with their current version, version count and batches awaiting
    review (``batches`` is apps.review's relation), for the datasets page."""
    return (Dataset.objects.filter(team=team)
            .select_related("project", "current_version")
            .annotate(version_count=Count("versions", distinct=True),
                      open_batches=Count("batches", distinct=True, filter=Q(
                          batches__status__in=("pending_review", "resampling"))))
            .order_by("slug"))
