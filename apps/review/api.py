"""Batches awaiting spot-check review, and the review items reviewers judge."""

from __future__ import annotations

from datetime import datetime

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.core.idempotency import idempotent
from apps.datasets.models import Dataset
from apps.review import selectors, services
from apps.review.models import (
    Batch,
    BatchStatus,
    BatchTransition,
    ItemStatus,
    ReviewItem,
    Verdict,
)
from apps.runs.models import Run
from apps.teams.viewsets import TeamScopedViewSet


class VersionRefSerializer(serializers.Serializer):
    digest = serializers.CharField()
    number = serializers.IntegerField()


class DecisionSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(choices=["accept", "reject", "resample", "pending"])
    reviewed = serializers.IntegerField()
    rejected = serializers.IntegerField()
    sample_size = serializers.IntegerField()
    population = serializers.IntegerField()
    target = serializers.FloatField()
    confidence = serializers.FloatField()
    upper = serializers.FloatField(allow_null=True,
                                   help_text="Clopper-Pearson upper bound on the error rate")
    lower = serializers.FloatField(allow_null=True,
                                   help_text="Clopper-Pearson lower bound on the error rate")
    next_sample_size = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField()


class ItemCountsSerializer(serializers.Serializer):
    open = serializers.IntegerField(source="items_open")
    accepted = serializers.IntegerField(source="items_accepted")
    rejected = serializers.IntegerField(source="items_rejected")


class BatchTransitionSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_label", read_only=True)

    class Meta:
        model = BatchTransition
        fields = ["from_status", "to_status", "reason", "actor", "created_at"]
        read_only_fields = fields


class BatchSerializer(serializers.ModelSerializer):
    dataset = serializers.CharField(source="dataset.slug", read_only=True)
    run = serializers.UUIDField(source="run_id", read_only=True, allow_null=True)
    decision = DecisionSerializer(read_only=True)
    items = ItemCountsSerializer(source="*", read_only=True)
    version = VersionRefSerializer(read_only=True, allow_null=True,
                                   help_text="the dataset version an accepted batch became")
    created_by = serializers.CharField(source="created_by.username", read_only=True,
                                       allow_null=True, default=None)
    transitions = BatchTransitionSerializer(many=True, read_only=True,
                                            help_text="the batch's state history, oldest first")

    class Meta:
        model = Batch
        fields = ["id", "name", "dataset", "run", "status", "digest", "record_count",
                  "size_bytes", "manifest", "target_error_rate", "confidence", "sample_seed",
                  "sample_size", "decision", "items", "version", "created_by", "created_at",
                  "decided_at", "transitions"]
        read_only_fields = fields


class BatchCreateSerializer(serializers.Serializer):
    dataset = serializers.SlugField(max_length=64, help_text="the dataset the batch targets")
    records = serializers.ListField(child=serializers.JSONField(), allow_empty=False,
                                    help_text="candidate records (JSON objects), in order")
    trails = serializers.ListField(
        child=serializers.JSONField(), required=False, allow_null=True, default=None,
        help_text="one verification trail per record (e.g. the stages it passed)")
    manifest = serializers.DictField(
        required=False, default=dict,
        help_text="from the engine: generator config, seed, parents (dataset references), "
                  "stage statistics, rejection reasons, distinct-n")

    def validate_manifest(self, value: dict) -> dict:
        return limits.check_json(value, field="manifest", limit=limits.MANIFEST_BYTES)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    run = serializers.UUIDField(required=False, allow_null=True, default=None,
                                help_text="the run that generated the records")
    target_error_rate = serializers.FloatField(required=False, default=0.05)
    confidence = serializers.FloatField(required=False, default=0.95)
    sample_seed = serializers.IntegerField(required=False, allow_null=True, default=None,
                                           min_value=-(2**63), max_value=2**63 - 1)


class ReviewItemSerializer(serializers.ModelSerializer):
    batch = serializers.UUIDField(source="batch_id", read_only=True)
    dataset = serializers.CharField(source="batch.dataset.slug", read_only=True)
    reviewed_by = serializers.CharField(source="reviewed_by.username", read_only=True,
                                        allow_null=True, default=None)
    locked_by = serializers.SerializerMethodField()
    lock_expires_at = serializers.SerializerMethodField()

    class Meta:
        model = ReviewItem
        fields = ["id", "batch", "dataset", "index", "round", "record", "trail", "status",
                  "reason", "reviewed_by", "reviewed_at", "locked_by", "lock_expires_at",
                  "created_at"]
        read_only_fields = fields

    def get_locked_by(self, obj: ReviewItem) -> str | None:
        holder = obj.lock_holder()
        return holder.username if holder else None

    def get_lock_expires_at(self, obj: ReviewItem) -> datetime | None:
        return obj.lock_expires_at if obj.lock_holder() else None


class VerdictSerializer(serializers.Serializer):
    verdict = serializers.ChoiceField(choices=Verdict.choices)
    reason = serializers.CharField(max_length=services.MAX_REASON, required=False,
                                   allow_blank=True, default="",
                                   help_text="required when rejecting")


class VerdictResultSerializer(serializers.Serializer):
    item = ReviewItemSerializer()
    batch = BatchSerializer()


class BatchViewSet(TeamScopedViewSet):
    """Batches of synthesized records; each is accepted or rejected by spot-check review."""

    queryset = Batch.objects.all()
    serializer_class = BatchSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "batch"
    lookup_value_regex = "[0-9a-fA-F-]{36}"
    filterset_fields = {"status": ["exact", "in"], "dataset__slug": ["exact"]}
    ordering_fields = ["created_at"]
    ordering = "-created_at"

    def base_queryset(self):
        return selectors.with_counts(self.queryset)

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(BatchSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, batch: str) -> Response:
        return Response(BatchSerializer(self.get_object()).data)

    @extend_schema(request=BatchCreateSerializer, responses={201: BatchSerializer})
    def create(self, request: Request, team: str) -> Response:
        """Store an engine result (records + manifest) and draw its review sample."""
        return idempotent(request, lambda: self._create(request))

    def _create(self, request: Request) -> Response:
        data = BatchCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        dataset = Dataset.objects.filter(team=self.team, slug=values["dataset"]).first()
        if dataset is None:
            raise InvalidInput(f"No dataset '{values['dataset']}' in team '{self.team.slug}'; "
                               "create it first.", details={"dataset": [values["dataset"]]})
        run = None
        if values["run"] is not None:
            run = Run.objects.filter(team=self.team, pk=values["run"]).first()
            if run is None:
                raise InvalidInput(f"No run '{values['run']}' in team '{self.team.slug}'.",
                                   details={"run": [str(values["run"])]})
        batch = services.batch_create(
            actor=self.actor, dataset=dataset, records=values["records"],
            manifest=values["manifest"], trails=values["trails"], run=run, name=values["name"],
            target_error_rate=values["target_error_rate"], confidence=values["confidence"],
            sample_seed=values["sample_seed"],
        )
        return Response(BatchSerializer(self.get_queryset().get(pk=batch.pk)).data,
                        status=status.HTTP_201_CREATED)


class ReviewItemFilter(django_filters.FilterSet):
    # A plain UUID, not a model choice: an id from another team filters to nothing instead
    # of revealing (by a 400) whether it exists.
    batch = django_filters.UUIDFilter(field_name="batch_id")
    status = django_filters.ChoiceFilter(choices=ItemStatus.choices)
    dataset = django_filters.CharFilter(field_name="batch__dataset__slug")
    batch_status = django_filters.MultipleChoiceFilter(field_name="batch__status",
                                                       choices=BatchStatus.choices)

    class Meta:
        model = ReviewItem
        fields = ["batch", "status", "dataset", "batch_status"]


class ReviewItemViewSet(TeamScopedViewSet):
    """The review queue: sampled records of the team's batches. Claim an item to hold it
    while you judge it (the lock expires); then accept it, or reject it with a reason."""

    queryset = ReviewItem.objects.all()
    serializer_class = ReviewItemSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "item"
    lookup_value_regex = "[0-9]+"
    filterset_class = ReviewItemFilter
    ordering_fields = ["id", "created_at"]
    ordering = "id"

    def base_queryset(self):
        return selectors.items_with_relations(self.queryset)

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(ReviewItemSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, item: str) -> Response:
        return Response(ReviewItemSerializer(self.get_object()).data)

    def _fresh(self, obj: ReviewItem) -> ReviewItem:
        return self.get_queryset().get(pk=obj.pk)

    @extend_schema(request=None, responses=ReviewItemSerializer)
    @action(detail=True, methods=["post"])
    def claim(self, request: Request, team: str, item: str) -> Response:
        """Lock the item to you (409 while another reviewer holds it); again to renew."""
        obj = services.claim(actor=self.actor, item=self.get_object())
        return Response(ReviewItemSerializer(self._fresh(obj)).data)

    @extend_schema(request=None, responses=ReviewItemSerializer)
    @action(detail=True, methods=["post"])
    def release(self, request: Request, team: str, item: str) -> Response:
        obj = services.release(actor=self.actor, item=self.get_object())
        return Response(ReviewItemSerializer(self._fresh(obj)).data)

    @extend_schema(request=None, responses=VerdictResultSerializer)
    @action(detail=True, methods=["post"])
    def undo(self, request: Request, team: str, item: str) -> Response:
        """Take back your verdict while the batch is still being decided (409 otherwise)."""
        obj = self._fresh(services.undo_verdict(actor=self.actor, item=self.get_object()))
        batch = selectors.with_counts(Batch.objects.filter(pk=obj.batch_id)).get()
        return Response({"item": ReviewItemSerializer(obj).data,
                         "batch": BatchSerializer(batch).data})

    @extend_schema(request=VerdictSerializer, responses=VerdictResultSerializer)
    @action(detail=True, methods=["post"])
    def verdict(self, request: Request, team: str, item: str) -> Response:
        """Accept, or reject with a reason; the batch's decision is updated at once."""
        data = VerdictSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.verdict(actor=self.actor, item=self.get_object(),
                               verdict=data.validated_data["verdict"],
                               reason=data.validated_data["reason"])
        obj = self._fresh(obj)
        batch = selectors.with_counts(Batch.objects.filter(pk=obj.batch_id)).get()
        return Response({"item": ReviewItemSerializer(obj).data,
                         "batch": BatchSerializer(batch).data})

