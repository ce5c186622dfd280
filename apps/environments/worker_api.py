"""The worker side of a ``qc`` run: its report sets the pinned version's QC status, under
the run's lease (workers hold no database access)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.core.protocol import parse
from apps.core.viewsets import WorkerViewSet
from apps.environments import services
from apps.runs.models import Run
from apps.runs.objects import check_reported
from apps.runs.selectors import run_for_worker
from apps.runs.services import check_lease
from workers import protocol


class WorkerQcViewSet(WorkerViewSet):
    def _run(self, run: str) -> Run:
        return run_for_worker(team_id=self.principal.team_id, run=run,
                              related=("environment_version__environment",))

    @extend_schema(request=protocol.QcReport, responses=protocol.QcResult)
    def create(self, request: Request, run: str) -> Response:
        obj = self._run(run)
        check_lease(obj, self.lease_id)
        if obj.kind != "qc" or obj.environment_version is None:
            raise InvalidInput(f"Run {obj.pk} is not a QC run of an environment version.",
                               details={"run": [obj.kind]})
        body = parse(protocol.QcReport, request.data)
        limits.check_json(body.report, field="report", limit=limits.REPORT_BYTES)
        check_reported(obj, body.uri)
        version = services.record_qc_report(
            actor=self.actor, version=obj.environment_version, report=body.report,
            run_id=str(obj.pk), report_uri=body.uri)
        return Response({"environment": version.environment.slug, "digest": version.digest,
                         "qc_status": version.qc_status})
