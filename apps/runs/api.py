"""Runs for people: launch (with preview), list, inspect, cancel, resume, and read
events, metrics, checkpoints, samples and reports."""

from __future__ import annotations

from django.conf import settings
from django.http import FileResponse, HttpResponseRedirect
from django.http.response import HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import InvalidInput, NotFound
from apps.core.idempotency import idempotent
from apps.core.renderers import FastJSONRenderer
from apps.core.storage import store
from apps.filtering import selectors as filter_selectors
from apps.metrics import selectors as metric_selectors
from apps.runs import comparison, selectors, services
from apps.runs.dashboard import MAX_COMPARE
from apps.runs.launch import Launch, run_launch
from apps.runs.models import Run, RunEvent, RunTag
from apps.runs.serializers import (
    CheckpointSerializer,
    RunCreateSerializer,
    RunDetailSerializer,
    RunEventSerializer,
    RunSerializer,
    SampleSerializer,
)
from apps.runs.validation import TAG_PATTERN
from apps.teams.viewsets import TeamScopedViewSet
from workers.storage import S3Store


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise InvalidInput(f"{name} must be an integer.", details={name: [raw]}) from exc
    if not low <= value <= high:
        raise InvalidInput(f"{name} must be between {low} and {high}.", details={name: [raw]})
    return value


class RunViewSet(TeamScopedViewSet):
    queryset = Run.objects.all()
    serializer_class = RunSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "run"
    filterset_fields = {
        "status": ["exact", "in"],
        "kind": ["exact"],
        "pool": ["exact"],
        "project__slug": ["exact"],
    }
    ordering_fields = ["created_at", "priority", "updated_at"]
    ordering = "-created_at"

    def base_queryset(self):
        if self.action == "metrics":
            # The read needs only the run's id: its relations cost 7 queries, more than the
            # rollup read of a 1M-point series itself.
            return self.queryset.only("pk", "team_id")
        return selectors.runs_with_relations(self.queryset)

    @extend_schema(parameters=[OpenApiParameter(
        "tag", OpenApiTypes.STR, many=True,
        description="runs carrying this tag (repeat for runs carrying all of them)")])
    def list(self, request: Request, team: str) -> Response:
        runs = self.filter_queryset(self.get_queryset())
        for tag in request.query_params.getlist("tag"):
            if not TAG_PATTERN.fullmatch(tag):
                raise InvalidInput(f"tag {tag[:60]!r} is not a tag; a tag is 1 to 40 letters, "
                                   "digits, '-', '_' or '.'.", details={"tag": [tag[:60]]})
            runs = runs.filter(pk__in=RunTag.objects.filter(team=self.team, tag=tag)
                               .values("run_id"))
        page = self.paginate_queryset(runs)
        return self.get_paginated_response(RunSerializer(page, many=True).data)

    @extend_schema(responses=RunDetailSerializer)
    def retrieve(self, request: Request, team: str, run: str) -> Response:
        return Response(RunDetailSerializer(self.get_object()).data)

    def _launch(self, request: Request, *, preview: bool) -> Launch:
        data = RunCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return run_launch(actor=self.actor, team=self.team, document=data.validated_data,
                          preview=preview)

    @extend_schema(request=RunCreateSerializer, responses={201: RunSerializer})
    def create(self, request: Request, team: str) -> Response:
        def handler() -> Response:
            launched = self._launch(request, preview=False)
            run = self.get_queryset().get(pk=launched.run.pk)
            return Response(RunSerializer(run).data, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(request=RunCreateSerializer, responses=OpenApiTypes.OBJECT)
    @action(detail=False, methods=["post"])
    def preview(self, request: Request, team: str) -> Response:
        """Validate and resolve a launch request; creates nothing."""
        return Response({"valid": True, "run": self._launch(request, preview=True).describe()})

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, team: str, run: str) -> Response:
        obj = services.cancel(actor=self.actor, run=self.get_object())
        return Response(RunSerializer(self.get_queryset().get(pk=obj.pk)).data)

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, team: str, run: str) -> Response:
        obj = services.resume(actor=self.actor, run=self.get_object())
        return Response(RunSerializer(self.get_queryset().get(pk=obj.pk)).data)

    @extend_schema(
        parameters=[OpenApiParameter("after", OpenApiTypes.INT, description="last seq seen"),
                    OpenApiParameter("limit", OpenApiTypes.INT)],
        responses=RunEventSerializer(many=True),
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, team: str, run: str) -> Response:
        obj = self.get_object()
        after = _int_param(request, "after", 0, 0, 2**62)
        limit = _int_param(request, "limit", 200, 1, 1000)
        rows = list(RunEvent.objects.filter(run=obj, seq__gt=after).order_by("seq")[:limit])
        return Response({
            "results": RunEventSerializer(rows, many=True).data,
            "last_seq": rows[-1].seq if rows else after,
            "more": len(rows) == limit,
        })

    @extend_schema(
        parameters=[OpenApiParameter("name", OpenApiTypes.STR, many=True),
                    OpenApiParameter("max_points", OpenApiTypes.INT),
                    OpenApiParameter("layout", OpenApiTypes.STR, enum=["points", "columns"],
                                     description="points: a list of objects per series; "
                                     "columns: parallel arrays (step, min, max, last, count, "
                                     "wall)"),
                    OpenApiParameter("after_step", OpenApiTypes.INT,
                                     description="polling cursor: only the raw points after "
                                                 "this step (at most max_points per series, "
                                                 "oldest first; `more` says if others follow)")],
        responses=OpenApiTypes.OBJECT,
    )
    @action(detail=True, methods=["get"], renderer_classes=[FastJSONRenderer])
    def metrics(self, request: Request, team: str, run: str) -> Response:
        """Series downsampled in the database to at most ``max_points`` buckets each; with
        ``after_step``, the raw points after that step instead (cheap polling: ask again with
        each series' ``last_step``)."""
        obj = self.get_object()
        cap = settings.CRUCIBLE["MAX_DOWNSAMPLE_POINTS"]
        max_points = _int_param(request, "max_points", 1000, 1, cap)
        layout = request.query_params.get("layout", "points")
        if layout not in ("points", "columns"):
            raise InvalidInput("layout must be 'points' or 'columns'.",
                               details={"layout": [layout[:40]]})
        infos = metric_selectors.run_series(obj.pk)
        available = list(infos)
        names = request.query_params.getlist("name") or available
        unknown = [n for n in names if n not in available]
        if unknown:
            raise InvalidInput(f"Run has no metric named {unknown[0]!r}.",
                               details={"name": unknown})
        if request.query_params.get("after_step") is not None:
            after = _int_param(request, "after_step", 0, -(2**63), 2**63 - 1)
            series, more = [], False
            for n in names:
                points, truncated = metric_selectors.points_after(
                    obj.pk, n, after_step=after, limit=max_points)
                more = more or truncated
                series.append({"name": n, "points": points, "more": truncated,
                               "last_step": points[-1]["step"] if points else after})
            return Response({"names": available, "max_points": max_points,
                             "after_step": after, "more": more, "series": series})
        if layout == "columns":
            columns = metric_selectors.series_columns(obj.pk, names, max_points=max_points,
                                                      infos=infos)
            series = [{"name": n, "columns": columns[n]} for n in names]
        else:
            by_name = metric_selectors.series_many(obj.pk, names, max_points=max_points)
            series = [{"name": n, "points": by_name[n]} for n in names]
        return Response({"names": available, "max_points": max_points, "layout": layout,
                         "series": series})

    @extend_schema(
        parameters=[OpenApiParameter("run", OpenApiTypes.UUID, many=True,
                                     description=f"1 to {MAX_COMPARE} run ids"),
                    OpenApiParameter("name", OpenApiTypes.STR, many=True,
                                     description="metrics to overlay (default: all)"),
                    OpenApiParameter("max_points", OpenApiTypes.INT),
                    OpenApiParameter("all", OpenApiTypes.BOOL,
                                     description="every config key, not only those that "
                                                 "differ")],
        responses=OpenApiTypes.OBJECT,
    )
    @action(detail=False, methods=["get"])
    def compare(self, request: Request, team: str) -> Response:
        """The compare page's data: overlaid metric series, the config diff, reports side
        by side with regressions marked."""
        cap = settings.CRUCIBLE["MAX_DOWNSAMPLE_POINTS"]
        names = request.query_params.getlist("name") or None
        return Response(comparison.compare(
            team=self.team, ids=comparison.run_ids(request.query_params.getlist("run")),
            names=names, max_points=_int_param(request, "max_points", 300, 1, cap),
            all_keys=request.query_params.get("all") in ("1", "true", "yes")))

    @extend_schema(responses=CheckpointSerializer(many=True))
    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, team: str, run: str) -> Response:
        rows = self.get_object().checkpoints.order_by("step")
        return Response({"results": CheckpointSerializer(rows, many=True).data})

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY,
                              302: None, 404: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["get"], url_path=r"checkpoints/(?P<step>[0-9]{1,19})/download")
    def checkpoint_download(self, request: Request, team: str, run: str, step: str
                            ) -> HttpResponseBase:
        """The checkpoint's file: streamed from a local object store, or a redirect to a
        signed, 5-minute URL on S3. Resolved through the database (run, step), never from a
        path the caller names."""
        obj = self.get_object()
        ckpt = obj.checkpoints.filter(step=int(step)).first()
        if ckpt is None:
            raise NotFound(f"Run {obj.pk} has no checkpoint at step {step}.")
        if ckpt.pruned_at is not None:
            raise NotFound(f"The checkpoint at step {step} was pruned by checkpoint.keep; its "
                           "object is deleted.")
        filename = f"{obj.pk}-step-{ckpt.step}-{ckpt.uri.rstrip('/').rsplit('/', 1)[-1]}"
        objects = store()
        try:
            if isinstance(objects, S3Store):
                return HttpResponseRedirect(objects.presigned_url(ckpt.uri, filename=filename))
            handle = objects.open_binary(ckpt.uri)
        except (ValueError, OSError) as exc:
            raise NotFound(f"Checkpoint at step {step} is not in the object store "
                           "(deleted, or written elsewhere).") from exc
        return FileResponse(handle, as_attachment=True, filename=filename,
                            content_type="application/octet-stream")

    @extend_schema(
        parameters=[OpenApiParameter("step", OpenApiTypes.INT, description="only this step"),
                    OpenApiParameter("limit", OpenApiTypes.INT)],
        responses=SampleSerializer(many=True))
    @action(detail=True, methods=["get"])
    def samples(self, request: Request, team: str, run: str) -> Response:
        """Newest first; ``step`` narrows to one step (its samples as generated)."""
        obj = self.get_object()
        limit = _int_param(request, "limit", 100, 1, 1000)
        rows = obj.samples.all()
        if request.query_params.get("step") is not None:
            step = _int_param(request, "step", 0, 0, 2**63 - 1)
            rows = rows.filter(step=step).order_by("id")
        else:
            rows = rows.order_by("-step", "-id")
        page = list(rows[:limit])
        filter_selectors.attach_flags(obj.team_id, page)
        return Response({"results": SampleSerializer(page, many=True).data})

    @extend_schema(responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"])
    def report(self, request: Request, team: str, run: str) -> Response:
        return Response(selectors.report(self.get_object()))
