"""Writes for spot-check review: create a batch from an engine result, claim and release
review items, record verdicts, and move the batch through its state machine as the
acceptance-sampling decision changes. Every write is transactional, audited, and publishes
its event on commit; every state change inserts a transition row.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Model
from django.utils import timezone

from apps.core import audit
from apps.core.actor import Actor
from apps.core.events import publish_on_commit, team_group
from apps.core.exceptions import Conflict, Forbidden, IllegalTransition, InvalidInput
from apps.core.storage import store
from apps.datasets import records as rec
from apps.datasets import services as dataset_services
from apps.datasets.models import Dataset, DatasetVersion
from apps.datasets.selectors import resolve_version
from apps.lineage import services as lineage
from apps.review import acceptance
from apps.review.models import (
    BATCH_TRANSITIONS,
    Batch,
    BatchStatus,
    BatchTransition,
    ItemStatus,
    ReviewItem,
    ReviewTransition,
    Verdict,
)
from apps.review.sampling import sample_indices
from apps.runs.leases import leased
from apps.runs.models import Run

MAX_MANIFEST_BYTES = 1_000_000
#: The field in which the synthesis engine keeps a record's verification trail.
TRAIL_FIELD = "verification"
MAX_REASON = 2_000


def lock_seconds() -> int:
    """How long a claimed item stays with its reviewer without a verdict."""
    return int(settings.CRUCIBLE.get("REVIEW_LOCK_SECONDS", 600))


# --- batches ----------------------------------------------------------------------------


def _digest_ref(team_id: int, digest: str) -> DatasetVersion | None:
    return (DatasetVersion.objects.filter(team_id=team_id, digest=digest)
            .select_related("dataset").order_by("id").first())


def _resolve_parents(dataset: Dataset, refs: Any) -> list[DatasetVersion]:
    if refs is None:
        return []
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise InvalidInput("manifest.parents must be a list of dataset references "
                           "(slug@v<number>, slug@<digest prefix> or a full digest).",
                           details={"manifest": ["parents: expected a list of strings"]})
    found = []
    for ref in refs:
        is_digest = len(ref) == 64 and all(c in "0123456789abcdef" for c in ref)
        version = _digest_ref(dataset.team_id, ref) if is_digest else None
        if version is None:
            try:
                version = resolve_version(team=dataset.team, ref=ref)
            except InvalidInput as exc:
                raise InvalidInput(f"manifest.parents: {exc.message}",
                                   details={"manifest": [f"parents: unknown '{ref}'"]}) from exc
        found.append(version)
    return found


def _check_manifest(manifest: Any) -> dict[str, Any]:
    if manifest is None:
        return {}
    if not isinstance(manifest, dict):
        raise InvalidInput("manifest must be a JSON object.", details={"manifest": ["object"]})
    size = len(json.dumps(manifest, default=str))
    if size > MAX_MANIFEST_BYTES:
        raise InvalidInput(f"manifest is {size} bytes; at most {MAX_MANIFEST_BYTES}. Keep "
                           "per-record details in the records or trails.",
                           details={"manifest": ["too large"]})
    seed = manifest.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidInput("manifest.seed must be an integer.", details={"manifest": ["seed"]})
    return manifest


def _check_plan(target: float, confidence: float) -> None:
    if not 0.0 < target < 1.0:
        raise InvalidInput(f"target_error_rate must be between 0 and 1 (exclusive), not "
                           f"{target}; e.g. 0.05 for at most 5 % bad records.",
                           details={"target_error_rate": [str(target)]})
    if not 0.5 <= confidence < 1.0:
        raise InvalidInput(f"confidence must be at least 0.5 and below 1, not {confidence}; "
                           "e.g. 0.95.", details={"confidence": [str(confidence)]})


def batch_create(
    *,
    actor: Actor,
    dataset: Dataset,
    records: Iterable[Any],
    manifest: dict[str, Any] | None = None,
    trails: list[Any] | None = None,
    run: Run | None = None,
    name: str = "",
    target_error_rate: float = 0.05,
    confidence: float = 0.95,
    sample_seed: int | None = None,
) -> Batch:
    """Store an engine's candidate records as a batch awaiting review and draw the seeded
    review sample. Nothing is written when any input is bad."""
    _check_plan(target_error_rate, confidence)
    manifest = _check_manifest(manifest)
    parents = _resolve_parents(dataset, manifest.get("parents"))
    if run is not None and run.team_id != dataset.team_id:
        raise InvalidInput("The run belongs to another team.", details={"run": ["unknown"]})
    if trails is not None and not isinstance(trails, list):
        raise InvalidInput("trails must be a list (one verification trail per record).",
                           details={"trails": ["list"]})
    folder = settings.VAR_DIR / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    canonical = rec.write_canonical(records, folder=folder,
                                    max_records=settings.CRUCIBLE["MAX_UPLOAD_RECORDS"])
    try:
        count = canonical.record_count
        if trails is not None and len(trails) != count:
            raise InvalidInput(f"trails has {len(trails)} entries for {count} records; send one "
                               "trail per record, in the same order.",
                               details={"trails": ["length mismatch"]})
        seed = sample_seed if sample_seed is not None else secrets.randbits(62)
        size = acceptance.sample_size(target_error_rate, confidence, population=count)
        chosen = sample_indices(seed=seed, population=count, size=size)
        wanted = set(chosen)
        sampled: dict[int, dict[str, Any]] = {}
        with canonical.path.open("rb") as handle:
            for index, line in enumerate(handle):
                if index in wanted:
                    sampled[index] = json.loads(line)
        uri = store().put_file(f"batches/{canonical.digest[:2]}/{canonical.digest}.jsonl",
                               canonical.path)
    finally:
        canonical.path.unlink(missing_ok=True)
    trails_uri = ""
    if trails is not None:
        body = b"".join(rec.canonical_line({"trail": t}) + b"\n" for t in trails)
        trails_uri = store().put_bytes(
            f"batches/{canonical.digest[:2]}/{canonical.digest}-{secrets.token_hex(8)}"
            ".trails.jsonl", body)
    with transaction.atomic():
        batch = Batch.objects.create(
            team_id=dataset.team_id, dataset=dataset, run=run, name=name[:200],
            digest=canonical.digest, uri=uri, trails_uri=trails_uri, record_count=count,
            size_bytes=canonical.size_bytes, schema=canonical.schema, manifest=manifest,
            target_error_rate=target_error_rate, confidence=confidence, sample_seed=seed,
            sample_size=size, created_by=actor.user,
        )
        if parents:
            batch.parents.set(parents)
        _add_items(batch, chosen, sampled, trails, round_=1)
        _record_transition(batch, actor, "", BatchStatus.PENDING_REVIEW,
                           f"{count} records; reviewing a sample of {size}")
        _reassess(batch, actor)
        audit.record(actor=actor, action="review.batch.create", team_id=batch.team_id,
                     target_type="batch", target_id=batch.pk,
                     data={"dataset": dataset.slug, "records": count, "sample": size,
                           "target_error_rate": target_error_rate, "confidence": confidence,
                           "run": str(run.pk) if run else None})
    return batch


def batch_from_run(*, actor: Actor, run: Run, lease_id: str, **fields: Any) -> Batch:
    """A synthesize run's hand-over of its result: :func:`batch_create` under the run's
    lease, so a worker that lost its run cannot file a batch for it."""
    with transaction.atomic():
        return batch_create(actor=actor, run=leased(run, lease_id), **fields)

def _trail(record: dict[str, Any], given: Any) -> Any:
    """A record's verification trail: given separately, else the engine's ``verification``
    field inside the record."""
    if given is not None:
        return given
    return record.get(TRAIL_FIELD, [])


def _add_items(batch: Batch, indices: list[int], records: dict[int, dict[str, Any]],
               trails: list[Any] | dict[int, Any] | None, *, round_: int) -> None:
    ReviewItem.objects.bulk_create([
        ReviewItem(team_id=batch.team_id, batch=batch, index=i, round=round_, record=records[i],
                   trail=_trail(records[i], trails[i] if trails is not None else None))
        for i in indices
    ])


def _read_positions(uri: str, wanted: set[int], *, key: str | None = None) -> dict[int, Any]:
    found: dict[int, Any] = {}
    if not uri or not wanted:
        return found
    last = max(wanted)
    for index, line in enumerate(store().open_lines(uri)):
        if index in wanted:
            value = json.loads(line)
            found[index] = value[key] if key else value
        if index >= last:
            break
    return found


def _record_transition(batch: Batch, actor: Actor, from_status: str, to_status: str,
                       reason: str, data: dict[str, Any] | None = None) -> None:
    if from_status and to_status not in BATCH_TRANSITIONS[from_status]:
        raise IllegalTransition(f"A batch cannot go from {from_status} to {to_status}.")
    BatchTransition.objects.create(batch=batch, from_status=from_status, to_status=to_status,
                                   reason=reason, data=data or {}, actor=actor.user,
                                   actor_label=actor.label)
    publish_on_commit(team_group(batch.team_id), {
        "type": "review_batch", "batch": str(batch.pk), "status": to_status,
        "by": actor.label,
    })


def _move(batch: Batch, actor: Actor, to_status: str, reason: str,
          data: dict[str, Any] | None = None) -> None:
    _record_transition(batch, actor, batch.status, to_status, reason, data)
    batch.status = to_status


def _reassess(batch: Batch, actor: Actor) -> acceptance.Decision:
    """Recompute the decision from the verdicts so far and act on it. Called with the
    batch row locked, inside the caller's transaction."""
    items = ReviewItem.objects.filter(batch=batch)
    reviewed = items.exclude(status=ItemStatus.OPEN).count()
    rejected = items.filter(status=ItemStatus.REJECTED).count()
    decision = acceptance.decide(population=batch.record_count, sample=batch.sample_size,
                                 reviewed=reviewed, rejected=rejected,
                                 target=batch.target_error_rate, confidence=batch.confidence)
    fields = ["decision", "status"]
    if decision.outcome == "accept":
        _move(batch, actor, BatchStatus.ACCEPTED, decision.reason, decision.as_dict())
        batch.version = _accept(batch, actor, decision)
        batch.decided_at = timezone.now()
        fields += ["version", "decided_at"]
    elif decision.outcome == "reject":
        _move(batch, actor, BatchStatus.REJECTED, decision.reason, decision.as_dict())
        batch.decided_at = timezone.now()
        fields.append("decided_at")
    elif decision.outcome == "resample":
        _resample(batch, actor, decision)
        fields.append("sample_size")
        decision = acceptance.decide(
            population=batch.record_count, sample=batch.sample_size, reviewed=reviewed,
            rejected=rejected, target=batch.target_error_rate, confidence=batch.confidence,
        )
    batch.decision = decision.as_dict()
    batch.save(update_fields=fields)
    return decision


def _resample(batch: Batch, actor: Actor, decision: acceptance.Decision) -> None:
    new_size = decision.next_sample_size
    assert new_size is not None and new_size > batch.sample_size
    indices = sample_indices(seed=batch.sample_seed, population=batch.record_count,
                             size=new_size)[batch.sample_size:]
    wanted = set(indices)
    records = _read_positions(batch.uri, wanted)
    trails = _read_positions(batch.trails_uri, wanted, key="trail")
    round_ = (ReviewItem.objects.filter(batch=batch).order_by("-round")
              .values_list("round", flat=True).first() or 1) + 1
    _add_items(batch, indices, records, trails if batch.trails_uri else None, round_=round_)
    _move(batch, actor, BatchStatus.RESAMPLING, decision.reason, decision.as_dict())
    batch.sample_size = new_size


def _accept(batch: Batch, actor: Actor, decision: acceptance.Decision) -> DatasetVersion:
    """The accepted batch becomes an immutable dataset version, its manifest carrying how
    the records were made and how they were reviewed."""
    parents = list(batch.parents.select_related("dataset").order_by("id"))
    manifest = {
        **batch.manifest,
        "parents": [{"dataset": p.dataset.slug, "number": p.number, "digest": p.digest}
                    for p in parents],
        "review": {
            "batch": str(batch.pk),
            "run": str(batch.run_id) if batch.run_id else None,
            "target_error_rate": batch.target_error_rate,
            "confidence": batch.confidence,
            "sample_seed": batch.sample_seed,
            "sample_size": batch.sample_size,
            "reviewed": decision.reviewed,
            "rejected": decision.rejected,
            "upper_bound": decision.upper,
            "reason": decision.reason,
        },
    }
    rows = (json.loads(line) for line in store().open_lines(batch.uri))
    version, created = dataset_services.version_create(
        actor=actor, dataset=batch.dataset, records=rows, parents=parents,
        message=f"accepted batch {batch.name or str(batch.pk)[:8]}"[:500], manifest=manifest,
        source=batch.run,
    )
    if not created and batch.run is not None:  # same records already a version: link it
        lineage.edge_create(team_id=batch.team_id, source=batch.run, target=version,
                            relation="produced")
    return version


# --- review items -----------------------------------------------------------------------


def _reviewer(actor: Actor) -> Any:
    if actor.user is None:
        raise Forbidden("Review items are claimed and judged by people, not tokens of workers.")
    return actor.user


def _take_write_lock(model: type[Model], pk: Any) -> None:
    """Make a transaction's first statement a write on SQLite (where FOR UPDATE is ignored):
    a transaction that reads first and writes later fails at once with "database is locked"
    when another writer committed in between (WAL snapshot upgrade), whereas a transaction
    that starts by writing waits for the lock under the busy timeout."""
    if connection.vendor == "sqlite":
        name = model._meta.pk.name
        model.objects.filter(pk=pk).update(**{name: F(name)})


def _locked_item(pk: int) -> ReviewItem:
    # FOR UPDATE OF the item only: PostgreSQL refuses to lock the nullable reviewer join.
    return (ReviewItem.objects.select_for_update(of=("self",)).select_related("locked_by")
            .get(pk=pk))


def _open_item(item: ReviewItem) -> tuple[Batch, ReviewItem]:
    """Lock the batch, then the item (always in that order), and check both are open."""
    _take_write_lock(Batch, item.batch_id)
    batch = Batch.objects.select_for_update().get(pk=item.batch_id)
    item = _locked_item(item.pk)
    if not batch.is_open:
        raise Conflict(f"Batch {batch} is {batch.status}; its items are closed.",
                       code="batch_closed")
    if item.status != ItemStatus.OPEN:
        who = item.reviewed_by.username if item.reviewed_by else "someone"
        raise Conflict(f"Item #{item.index} was already {item.status} by {who}.",
                       code="already_reviewed")
    return batch, item


def _held_by_other(item: ReviewItem, user: Any) -> None:
    holder = item.lock_holder()
    if holder is not None and holder.pk != user.pk:
        until = timezone.localtime(item.lock_expires_at).strftime("%H:%M:%S")
        raise Conflict(f"Item #{item.index} is being reviewed by {holder.username} until "
                       f"{until}; pick another item.", code="locked")


def _publish_item(item: ReviewItem, actor: Actor) -> None:
    holder = item.lock_holder()
    publish_on_commit(team_group(item.team_id), {
        "type": "review_item", "item": item.pk, "batch": str(item.batch_id),
        "status": item.status, "locked_by": holder.username if holder else None,
        "by": actor.label,
    })


@transaction.atomic
def claim(*, actor: Actor, item: ReviewItem) -> ReviewItem:
    """Hold an open item for this reviewer for ``lock_seconds()``; claiming again renews."""
    user = _reviewer(actor)
    _, item = _open_item(item)
    _held_by_other(item, user)
    item.locked_by = user
    item.lock_expires_at = timezone.now() + timedelta(seconds=lock_seconds())
    item.save(update_fields=["locked_by", "lock_expires_at"])
    audit.record(actor=actor, action="review.item.claim", team_id=item.team_id,
                 target_type="review_item", target_id=item.pk,
                 data={"until": item.lock_expires_at.isoformat()})
    _publish_item(item, actor)
    return item


@transaction.atomic
def release(*, actor: Actor, item: ReviewItem) -> ReviewItem:
    """Give up this reviewer's lock; releasing an item nobody holds changes nothing."""
    user = _reviewer(actor)
    _take_write_lock(ReviewItem, item.pk)
    item = _locked_item(item.pk)
    holder = item.lock_holder()
    if holder is None:
        return item
    if holder.pk != user.pk:
        raise Conflict(f"Item #{item.index} is held by {holder.username}, not you.",
                       code="locked")
    item.locked_by, item.lock_expires_at = None, None
    item.save(update_fields=["locked_by", "lock_expires_at"])
    audit.record(actor=actor, action="review.item.release", team_id=item.team_id,
                 target_type="review_item", target_id=item.pk)
    _publish_item(item, actor)
    return item


@transaction.atomic
def verdict(*, actor: Actor, item: ReviewItem, verdict: str, reason: str = "") -> ReviewItem:
    """Accept or reject one sampled record (a rejection needs a reason), then update the
    batch's decision: it may be accepted (becoming a dataset version), rejected, or grow
    its sample."""
    user = _reviewer(actor)
    reason = (reason or "").strip()
    if verdict not in Verdict.values:
        raise InvalidInput(f"verdict must be 'accept' or 'reject', not {verdict!r}.",
                           details={"verdict": [str(verdict)]})
    if verdict == Verdict.REJECT and not reason:
        raise InvalidInput("Say why the record is rejected: a reason is required.",
                           details={"reason": ["required to reject"]})
    if len(reason) > MAX_REASON:
        raise InvalidInput(f"reason is at most {MAX_REASON} characters.",
                           details={"reason": ["too long"]})
    batch, item = _open_item(item)
    _held_by_other(item, user)
    to_status = ItemStatus.ACCEPTED if verdict == Verdict.ACCEPT else ItemStatus.REJECTED
    ReviewTransition.objects.create(item=item, from_status=item.status, to_status=to_status,
                                    reason=reason, actor=user, actor_label=actor.label)
    item.status, item.reason = to_status, reason
    item.reviewed_by, item.reviewed_at = user, timezone.now()
    item.locked_by, item.lock_expires_at = None, None
    item.save(update_fields=["status", "reason", "reviewed_by", "reviewed_at", "locked_by",
                             "lock_expires_at"])
    audit.record(actor=actor, action=f"review.item.{to_status}", team_id=item.team_id,
                 target_type="review_item", target_id=item.pk,
                 data={"batch": str(batch.pk), "index": item.index, "reason": reason})
    _publish_item(item, actor)
    _reassess(batch, actor)
    return item


@transaction.atomic
def undo_verdict(*, actor: Actor, item: ReviewItem) -> ReviewItem:
    """Take back a verdict: the item is open again (a new transition row; history is kept)
    and the batch's decision is reassessed. Only the reviewer who gave it, and only while
    the batch is still being decided — an accepted batch is already a dataset version."""
    user = _reviewer(actor)
    _take_write_lock(Batch, item.batch_id)
    batch = Batch.objects.select_for_update().get(pk=item.batch_id)
    item = _locked_item(item.pk)
    if item.status == ItemStatus.OPEN:
        raise Conflict(f"Item #{item.index} has no verdict to undo.", code="no_verdict")
    if not batch.is_open:
        raise Conflict(f"Batch {batch} is already {batch.status}; its verdicts are final "
                       "(roll the dataset back instead).", code="batch_closed")
    if item.reviewed_by_id != user.pk:
        who = item.reviewed_by.username if item.reviewed_by else "someone else"
        raise Conflict(f"Item #{item.index} was judged by {who}; only they can undo it.",
                       code="not_yours")
    previous = item.status
    ReviewTransition.objects.create(item=item, from_status=previous, to_status=ItemStatus.OPEN,
                                    reason="verdict undone", actor=user,
                                    actor_label=actor.label)
    item.status, item.reason = ItemStatus.OPEN, ""
    item.reviewed_by, item.reviewed_at = None, None
    item.save(update_fields=["status", "reason", "reviewed_by", "reviewed_at"])
    audit.record(actor=actor, action="review.item.undo", team_id=item.team_id,
                 target_type="review_item", target_id=item.pk,
                 data={"batch": str(batch.pk), "index": item.index, "was": previous})
    _publish_item(item, actor)
    _reassess(batch, actor)
    return item
