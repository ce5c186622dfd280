"""Reads for datasets, including resolution of references like ``slug@v3``."""

from __future__ import annotations

import json
from itertools import islice
from typing import Any

from apps.core.exceptions import InvalidInput
from apps.core.storage import store
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
