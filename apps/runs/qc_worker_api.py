"""The worker side of a ``qc`` run: its report sets the pinned version's QC status, under
the run's lease (workers hold no database access)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.viewsets import WorkerViewSet
from apps.runs import services
from apps.runs.models import Run
from apps.runs.selectors import run_for_worker


class QcReportSerializer(serializers.Serializer):
    report = serializers.DictField(help_text="the QC engine's crucible.qc/1 report")

    def validate_report(self, value: dict) -> dict:
        return limits.check_json(value, field="report", limit=limits.REPORT_BYTES)
    uri = serializers.CharField(max_length=1000, help_text="the full report in the object store")


class QcResultSerializer(serializers.Serializer):
    environment = serializers.CharField()
    digest = serializers.CharField()
    qc_status = serializers.CharField()


class WorkerQcViewSet(WorkerViewSet):
    def _run(self, run: str) -> Run:
        return run_for_worker(team_id=self.principal.team_id, run=run,
                              related=("environment_version__environment",))

    @extend_schema(request=QcReportSerializer, responses=QcResultSerializer)
    def create(self, request: Request, run: str) -> Response:
        obj = self._run(run)
        data = QcReportSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version = services.report_qc(actor=self.actor, run=obj, lease_id=self.lease_id,
                                     report=data.validated_data["report"],
                                     uri=data.validated_data["uri"])
        return Response({"environment": version.environment.slug, "digest": version.digest,
                         "qc_status": version.qc_status})
