"""Reads for review: batches with their verdict counts, and the queue of items."""

from __future__ import annotations

from django.db.models import Count, Q, QuerySet

from apps.review.models import OPEN_BATCH_STATUSES, Batch, ItemStatus, ReviewItem
from apps.teams.models import Team


def with_counts(batches: QuerySet[Batch]) -> QuerySet[Batch]:
    """Batches annotated with ``items_open``, ``items_accepted``, ``items_rejected``."""
    return batches.select_related("dataset", "run", "version", "created_by").prefetch_related(
        "transitions").annotate(
        items_open=Count("items", filter=Q(items__status=ItemStatus.OPEN)),
        items_accepted=Count("items", filter=Q(items__status=ItemStatus.ACCEPTED)),
        items_rejected=Count("items", filter=Q(items__status=ItemStatus.REJECTED)),
    )


def team_batches(team: Team) -> QuerySet[Batch]:
    return with_counts(Batch.objects.filter(team=team)).order_by("-created_at")


def items_with_relations(items: QuerySet[ReviewItem]) -> QuerySet[ReviewItem]:
    return items.select_related("batch__dataset", "reviewed_by", "locked_by")


def queue(team: Team, *, batch: Batch | None = None) -> list[ReviewItem]:
    """Items to show on the review page: every item of ``batch``, or of the team's open
    batches. Open items first (in sample order), then decided ones — rejected items stay
    visible with their reason."""
    items = ReviewItem.objects.filter(team=team)
    if batch is not None:
        items = items.filter(batch=batch)
    else:
        items = items.filter(batch__status__in=OPEN_BATCH_STATUSES)
    rows = list(items_with_relations(items).order_by("batch__created_at", "id"))
    return sorted(rows, key=lambda i: i.status != ItemStatus.OPEN)
