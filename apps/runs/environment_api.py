"""The runs of one environment version, on the environment API's URLs: launch a QC or an
eval run of it (``…/versions/<digest>/qc``, ``…/eval``) and list its eval reports
(``…/evals``). They live with runs, which pin environments, so the environments app never
imports runs."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.idempotency import idempotent
from apps.core.serializers import StrictSerializer
from apps.environments.api import EnvironmentVersionViewSet
from apps.runs import selectors
from apps.runs.launch import run_launch
from apps.runs.models import Run
from apps.runs.serializers import RunSerializer


class VersionRunSerializer(StrictSerializer):
    """A QC or eval run of this version (the runs API's launch, with the pin filled in)."""

    config = serializers.DictField(required=False, default=dict)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    pool = serializers.CharField(required=False, allow_null=True, default=None, max_length=16)
    priority = serializers.IntegerField(required=False, default=0, min_value=-100,
                                        max_value=100)
    base_model = serializers.CharField(required=False, allow_null=True, default=None,
                                       max_length=300)


class EvalReportRowSerializer(serializers.Serializer):
    run = serializers.CharField()
    name = serializers.CharField()
    created_at = serializers.DateTimeField()
    report_uri = serializers.CharField()
    policy = serializers.JSONField(allow_null=True)
    split = serializers.CharField(allow_null=True)
    k = serializers.JSONField(allow_null=True)
    summary = serializers.JSONField(allow_null=True)
    error = serializers.CharField(allow_null=True)


class EnvironmentVersionRunsViewSet(EnvironmentVersionViewSet):
    """The environment version API plus the actions that launch and read its runs."""

    def _launch(self, request: Request, environment: str, version: str, kind: str) -> Response:
        obj = self._version(environment, version)
        data = VersionRunSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        launched = run_launch(actor=self.actor, team=self.team, document={
            "project": obj.environment.project.slug, "kind": kind, "config": values["config"],
            "name": values["name"], "pool": values["pool"], "priority": values["priority"],
            "base_model": values["base_model"],
            "environment": f"{obj.environment.slug}@v{obj.number}"})
        run = Run.objects.select_related("project").get(pk=launched.run.pk)
        return Response(RunSerializer(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=VersionRunSerializer, responses={201: RunSerializer})
    @action(detail=True, methods=["post"])
    def qc(self, request: Request, team: str, environment: str, version: str) -> Response:
        """Launch a QC run of this version; its report sets qc_status."""
        return idempotent(request, lambda: self._launch(request, environment, version, "qc"))

    @extend_schema(request=VersionRunSerializer, responses={201: RunSerializer})
    @action(detail=True, methods=["post"], url_path="eval")
    def evaluate(self, request: Request, team: str, environment: str, version: str
                 ) -> Response:
        """Launch an eval run of this version (config.policy or base_model)."""
        return idempotent(request, lambda: self._launch(request, environment, version, "eval"))

    @extend_schema(request=None, responses=EvalReportRowSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)  # a bounded plain list
    def evals(self, request: Request, team: str, environment: str, version: str) -> Response:
        """The version's eval reports (succeeded eval runs), newest first."""
        rows = selectors.environment_eval_reports(self._version(environment, version))
        return Response(EvalReportRowSerializer(rows, many=True).data)
