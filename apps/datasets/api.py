"""Datasets and versions. Versions are uploaded as JSON ``{"records": [...]}`` or as a
JSONL or Parquet file (multipart field ``file``; Parquet is recognised by its magic bytes)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import InvalidInput, NotFound
from apps.core.idempotency import idempotent
from apps.core.parsers import FastJSONParser
from apps.datasets import records as rec
from apps.datasets import selectors, services
from apps.datasets.diff import DEFAULT_KEYS
from apps.datasets.models import Dataset, DatasetVersion
from apps.filtering import services as filtering
from apps.filtering.models import Surface
from apps.projects.selectors import project_by_slug
from apps.teams.viewsets import TeamScopedViewSet
from workers.filtering import Mode, screen_value

MAX_OFFSET = 2**63 - 1  # record counts are BIGINT-sized; beyond that no record exists


class DatasetVersionSerializer(serializers.ModelSerializer):
    dataset = serializers.CharField(source="dataset.slug", read_only=True)
    parents = serializers.SlugRelatedField(slug_field="digest", many=True, read_only=True)

    class Meta:
        model = DatasetVersion
        fields = ["digest", "number", "dataset", "record_count", "size_bytes", "schema",
                  "message", "manifest", "parents", "uri", "created_at"]
        read_only_fields = fields


class DatasetSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug", read_only=True)
    current_version = DatasetVersionSerializer(read_only=True, allow_null=True,
                                               help_text="null until a version is uploaded")

    class Meta:
        model = Dataset
        fields = ["slug", "project", "description", "current_version", "created_at"]
        read_only_fields = fields


class DatasetCreateSerializer(serializers.Serializer):
    slug = serializers.SlugField(max_length=64)
    project = serializers.SlugField(max_length=64)
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True, default="")


class VersionUploadSerializer(serializers.Serializer):
    records = serializers.ListField(child=serializers.JSONField(), required=False)
    file = serializers.FileField(required=False)
    parents = serializers.ListField(child=serializers.CharField(max_length=limits.REF),
                                    required=False, default=list, max_length=64)
    message = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
    set_current = serializers.BooleanField(required=False, default=True)

    def validate(self, attrs: dict) -> dict:
        if ("records" in attrs) == ("file" in attrs):
            raise serializers.ValidationError(
                "Send exactly one of 'records' (a JSON list of objects) or 'file' (JSONL or "
                "Parquet)."
            )
        return attrs


class SetCurrentSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=limits.REF, help_text="digest or v<number>")


class RollbackSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=limits.REF,
                                    help_text="digest or v<number> of an earlier version")
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class RollbackResultSerializer(serializers.Serializer):
    dataset = DatasetSerializer()
    previous = DatasetVersionSerializer(allow_null=True)
    changed = serializers.BooleanField()


class DiffRefSerializer(serializers.Serializer):
    digest = serializers.CharField()
    number = serializers.IntegerField()


class DiffCountsSerializer(serializers.Serializer):
    old = serializers.IntegerField()
    new = serializers.IntegerField()
    added = serializers.IntegerField()
    removed = serializers.IntegerField()
    changed = serializers.IntegerField()
    unchanged = serializers.IntegerField()


class ChangedRecordSerializer(serializers.Serializer):
    key = serializers.JSONField()
    before = serializers.DictField()
    after = serializers.DictField()
    fields = serializers.ListField(child=serializers.CharField())


class DiffSerializer(serializers.Serializer):
    base = DiffRefSerializer(allow_null=True, help_text="null: compared with an empty dataset")
    version = DiffRefSerializer()
    mode = serializers.ChoiceField(choices=["key", "content"],
                                   help_text="records matched by key field or by content")
    key = serializers.CharField(allow_null=True)
    counts = DiffCountsSerializer()
    added = serializers.ListField(child=serializers.DictField())
    removed = serializers.ListField(child=serializers.DictField())
    changed = ChangedRecordSerializer(many=True)
    limit = serializers.IntegerField()
    truncated = serializers.BooleanField()


class DatasetViewSet(TeamScopedViewSet):
    queryset = Dataset.objects.select_related("project", "current_version__dataset")
    serializer_class = DatasetSerializer
    lookup_field = "slug"
    lookup_url_kwarg = "dataset"
    filterset_fields = {"project__slug": ["exact"]}
    ordering_fields = ["slug", "created_at"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        # Each row shows its current version's parents: one query for the page, not per row.
        rows = self.filter_queryset(self.get_queryset()).prefetch_related(
            "current_version__parents")
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(DatasetSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, dataset: str) -> Response:
        return Response(DatasetSerializer(self.get_object()).data)

    @extend_schema(request=DatasetCreateSerializer, responses={201: DatasetSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = DatasetCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = project_by_slug(team=self.team, slug=data.validated_data["project"])
        dataset = services.dataset_create(
            actor=self.actor, team=self.team, project=project, slug=data.validated_data["slug"],
            description=data.validated_data["description"],
        )
        return Response(DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=SetCurrentSerializer, responses=DatasetSerializer)
    @action(detail=True, methods=["post"], url_path="current")
    def set_current(self, request: Request, team: str, dataset: str) -> Response:
        data = SetCurrentSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = self.get_object()
        version = selectors.version_by_digest(dataset=obj, digest=data.validated_data["version"])
        if version is None:
            wanted = data.validated_data["version"]
            raise NotFound(f"Dataset '{obj.slug}' has no version '{wanted}'.")
        obj = services.set_current_version(actor=self.actor, dataset=obj, version=version)
        return Response(DatasetSerializer(obj).data)

    @extend_schema(request=RollbackSerializer, responses=RollbackResultSerializer)
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, team: str, dataset: str) -> Response:
        """Move the current version back to an earlier one (audited). Naming the current
        version again changes nothing (``changed: false``)."""
        data = RollbackSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = self.get_object()
        wanted = data.validated_data["version"]
        version = selectors.version_by_digest(dataset=obj, digest=wanted)
        if version is None:
            raise NotFound(f"Dataset '{obj.slug}' has no version '{wanted}'.")
        obj, previous = services.rollback(actor=self.actor, dataset=obj, version=version,
                                          reason=data.validated_data["reason"])
        obj = self.get_queryset().get(pk=obj.pk)
        return Response({"dataset": DatasetSerializer(obj).data,
                         "previous": DatasetVersionSerializer(previous).data if previous else None,
                         "changed": previous is None or previous.pk != version.pk})


class DatasetVersionViewSet(TeamScopedViewSet):
    queryset = DatasetVersion.objects.select_related("dataset").prefetch_related("parents")
    serializer_class = DatasetVersionSerializer
    parser_classes = [FastJSONParser, MultiPartParser, FormParser]
    lookup_field = "digest"
    lookup_url_kwarg = "version"
    ordering_fields = ["number", "created_at"]
    ordering = "-number"

    def base_queryset(self):
        return self.queryset.filter(dataset__slug=self.kwargs["dataset"])

    def _dataset(self) -> Dataset:
        dataset = Dataset.objects.filter(team=self.team, slug=self.kwargs["dataset"]).first()
        if dataset is None:
            raise NotFound(f"No dataset '{self.kwargs['dataset']}' in team '{self.team.slug}'.")
        return dataset

    def _version(self) -> DatasetVersion:
        version = selectors.version_by_digest(
            dataset=self._dataset(), digest=self.kwargs["version"]
        )
        if version is None:
            raise NotFound(f"No version '{self.kwargs['version']}' of '{self.kwargs['dataset']}'.")
        return version

    def list(self, request: Request, team: str, dataset: str) -> Response:
        self._dataset()
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(DatasetVersionSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, dataset: str, version: str) -> Response:
        return Response(DatasetVersionSerializer(self._version()).data)

    @extend_schema(request=VersionUploadSerializer, responses={201: DatasetVersionSerializer})
    def create(self, request: Request, team: str, dataset: str) -> Response:
        return idempotent(request, lambda: self._create(request))

    def _create(self, request: Request) -> Response:
        obj = self._dataset()
        data = VersionUploadSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        parents = []
        for ref in values["parents"]:
            parent = selectors.resolve_version(team=self.team, ref=ref)
            parents.append(parent)
        records = rec.parse_upload(values["file"]) if "file" in values else values["records"]
        version, created = services.version_create(
            actor=self.actor, dataset=obj, records=records, parents=parents,
            message=values["message"], set_current=values["set_current"],
        )
        return Response(DatasetVersionSerializer(version).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(
        parameters=[OpenApiParameter("offset", OpenApiTypes.INT),
                    OpenApiParameter("limit", OpenApiTypes.INT)],
        responses=OpenApiTypes.OBJECT,
    )
    @action(detail=True, methods=["get"])
    def records(self, request: Request, team: str, dataset: str, version: str) -> Response:
        obj = self._version()
        try:
            offset = int(request.query_params.get("offset", 0))
            limit = int(request.query_params.get("limit", 50))
        except ValueError as exc:
            raise InvalidInput("offset and limit must be integers.",
                               details={"offset": ["integer"], "limit": ["integer"]}) from exc
        if not 0 <= offset <= MAX_OFFSET or not 1 <= limit <= 1000:
            raise InvalidInput(f"offset must be between 0 and {MAX_OFFSET} and limit between 1 "
                               "and 1000.", details={"offset": [str(offset)[:30]],
                                                     "limit": [str(limit)[:30]]})
        # Past the last record there is nothing to read (and no file to scan).
        rows = (selectors.read_records(obj, offset=offset, limit=limit)
                if offset < obj.record_count else [])
        return Response({"offset": offset, "limit": limit, "total": obj.record_count,
                         "records": rows})

    @extend_schema(responses={(200, "application/x-ndjson"): OpenApiTypes.STR})
    @action(detail=True, methods=["get"])
    def export(self, request: Request, team: str, dataset: str, version: str
               ) -> StreamingHttpResponse:
        """The version's records as JSON lines, through the team's export filter: ``flag``
        sends them as stored and says what it found in ``X-Crucible-Filter-*`` headers,
        ``redact`` replaces each finding with ``[REDACTED:<kind>]``, ``block`` refuses
        (422 ``output_blocked``) a version with any finding."""
        obj = self._version()
        lines = selectors.record_lines(obj)
        screened = filtering.screen_jsonl(team_id=self.team.pk, surface=Surface.EXPORT,
                                          lines=lines, target=("dataset-version", obj.digest))

        def body() -> Iterator[bytes]:
            for i, line in enumerate(lines()):
                if screened.mode == Mode.REDACT and i in screened.hits:
                    yield rec.canonical_line(
                        screen_value(json.loads(line), Mode.REDACT).value) + b"\n"
                else:
                    yield line if line.endswith(b"\n") else line + b"\n"

        response = StreamingHttpResponse(body(), content_type="application/x-ndjson")
        response["Content-Disposition"] = (f'attachment; filename="{obj.dataset.slug}-'
                                           f'v{obj.number}.jsonl"')
        response["X-Crucible-Filter"] = screened.mode.value
        if screened.mode != Mode.OFF:
            kinds = sorted({k for ks in screened.hits.values() for k in ks})
            response["X-Crucible-Filter-Records"] = str(len(screened.hits))
            response["X-Crucible-Filter-Kinds"] = ",".join(kinds)
        return response

    @extend_schema(
        parameters=[
            OpenApiParameter("base", OpenApiTypes.STR,
                             description="digest or v<number> to compare with; default: the "
                                         "version's parent in this dataset, else the one "
                                         "before it"),
            OpenApiParameter("key", OpenApiTypes.STR,
                             description="record field that identifies a record; default: "
                                         "'id', else 'uid', when every record has a unique "
                                         "one; empty: match by content only"),
            OpenApiParameter("limit", OpenApiTypes.INT,
                             description="records shown per kind (1-1000, default 50)"),
        ],
        responses=DiffSerializer,
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, team: str, dataset: str, version: str) -> Response:
        """Records added, removed and changed from ``base`` to this version."""
        obj = self._version()
        base_ref = request.query_params.get("base")
        if base_ref:
            base = selectors.version_by_digest(dataset=obj.dataset, digest=base_ref)
            if base is None:
                raise InvalidInput(f"Dataset '{obj.dataset.slug}' has no version '{base_ref}'.",
                                   details={"base": [base_ref]})
        else:
            base = selectors.default_base(obj)
        raw_key = request.query_params.get("key")
        keys = DEFAULT_KEYS if raw_key is None else tuple(k for k in [raw_key.strip()] if k)
        try:
            limit = int(request.query_params.get("limit", 50))
        except ValueError as exc:
            raise InvalidInput("limit must be an integer.", details={"limit": ["integer"]}) \
                from exc
        if not 1 <= limit <= 1000:
            raise InvalidInput("limit must be between 1 and 1000.", details={"limit": [limit]})
        return Response(selectors.diff_versions(base=base, version=obj, keys=keys, limit=limit))
