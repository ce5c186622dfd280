"""Writes for datasets. A version's records reach the object store before its row is
created, so a failure leaves at most an orphaned, content-addressed object, never a row
pointing at nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Model

from apps.core import audit, limits
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, InvalidInput
from apps.core.storage import store
from apps.datasets import records as rec
from apps.datasets.models import Dataset, DatasetVersion
from apps.lineage import services as lineage
from apps.projects.models import Project
from apps.teams.models import Team


@transaction.atomic
def dataset_create(
    *, actor: Actor, team: Team, project: Project, slug: str, description: str = ""
) -> Dataset:
    limits.check_text(description, field="description", limit=limits.DESCRIPTION)
    if Dataset.objects.filter(team=team, slug=slug).exists():
        raise Conflict(f"Dataset '{slug}' already exists in team '{team.slug}'.")
    dataset = Dataset.objects.create(
        team=team, project=project, slug=slug, description=description, created_by=actor.user
    )
    audit.record(actor=actor, action="dataset.create", team_id=team.pk, target_type="dataset",
                 target_id=slug)
    return dataset


def version_create(
    *,
    actor: Actor,
    dataset: Dataset,
    records: Iterable[Any],
    parents: list[DatasetVersion] | None = None,
    message: str = "",
    set_current: bool = True,
    manifest: dict[str, Any] | None = None,
    source: Model | None = None,
) -> tuple[DatasetVersion, bool]:
    """Store records as a new version; returns (version, created).

    Uploading content identical to an existing version of the same dataset returns that
    version (created=False): versions are content-addressed. ``manifest`` (how the records
    were made: generator config, seed, stage statistics) is frozen with the version;
    ``source`` (e.g. the run that generated the records) gets a lineage edge to it.
    """
    for parent in parents or []:
        if parent.team_id != dataset.team_id:
            raise InvalidInput("A parent version belongs to another team.")
    folder = settings.VAR_DIR / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    limit = settings.CRUCIBLE["MAX_UPLOAD_RECORDS"]
    canonical = rec.write_canonical(records, folder=folder, max_records=limit,
                                    max_bytes=settings.CRUCIBLE["MAX_UPLOAD_BYTES"])
    try:
        existing = DatasetVersion.objects.filter(dataset=dataset, digest=canonical.digest).first()
        if existing is not None:
            return existing, False
        key = f"datasets/{canonical.digest[:2]}/{canonical.digest}.jsonl"
        uri = store().put_file(key, canonical.path)
    finally:
        canonical.path.unlink(missing_ok=True)
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
        existing = DatasetVersion.objects.filter(dataset=locked, digest=canonical.digest).first()
        if existing is not None:
            return existing, False
        number = (locked.versions.aggregate(n=Max("number"))["n"] or 0) + 1
        version = DatasetVersion.objects.create(
            team_id=locked.team_id, dataset=locked, number=number, digest=canonical.digest,
            uri=uri, record_count=canonical.record_count, size_bytes=canonical.size_bytes,
            schema=canonical.schema, message=message, created_by=actor.user,
            manifest=manifest or {},
        )
        if parents:
            version.parents.set(parents)
            for parent in parents:
                lineage.edge_create(team_id=locked.team_id, source=parent, target=version,
                                    relation="derived")
        if source is not None:
            lineage.edge_create(team_id=locked.team_id, source=source, target=version,
                                relation="produced")
        if set_current:
            locked.current_version = version
            locked.save(update_fields=["current_version"])
        audit.record(actor=actor, action="dataset.version.create", team_id=locked.team_id,
                     target_type="dataset_version", target_id=version.digest,
                     data={"dataset": locked.slug, "number": number,
                           "records": canonical.record_count})
    return version, True


@transaction.atomic
def set_current_version(*, actor: Actor, dataset: Dataset, version: DatasetVersion) -> Dataset:
    if version.dataset_id != dataset.pk:
        raise InvalidInput(f"Version {version.digest[:12]} is not a version of '{dataset.slug}'.")
    dataset.current_version = version
    dataset.save(update_fields=["current_version"])
    audit.record(actor=actor, action="dataset.current", team_id=dataset.team_id,
                 target_type="dataset", target_id=dataset.slug, data={"digest": version.digest})
    return dataset


@transaction.atomic
def rollback(*, actor: Actor, dataset: Dataset, version: DatasetVersion,
             reason: str = "") -> tuple[Dataset, DatasetVersion | None]:
    """Move the dataset's current version back to an earlier one; returns (dataset, the
    version that was current before). Rolling back to the current version changes nothing
    (a retried request is harmless); rolling "back" to a newer version is refused."""
    locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
    if version.dataset_id != locked.pk:
        raise InvalidInput(f"Version {version.digest[:12]} is not a version of '{locked.slug}'.")
    previous = (DatasetVersion.objects.get(pk=locked.current_version_id)
                if locked.current_version_id else None)
    if previous is not None and previous.pk == version.pk:
        return locked, previous
    if previous is not None and version.number > previous.number:
        raise Conflict(
            f"v{version.number} is newer than the current v{previous.number}; a rollback "
            f"goes back. To move forward, POST its digest to .../datasets/{locked.slug}/current."
        )
    locked.current_version = version
    locked.save(update_fields=["current_version"])
    audit.record(actor=actor, action="dataset.rollback", team_id=locked.team_id,
                 target_type="dataset", target_id=locked.slug,
                 data={"from": previous.digest if previous else None,
                       "from_number": previous.number if previous else None,
                       "to": version.digest, "to_number": version.number,
                       "reason": reason})
    return locked, previous
