"""The worker side of a ``qc`` run: its report sets the pinned version's QC status, under
the run's lease (workers hold no database access)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.protocol import parse
from apps.runs import services
from apps.runs.models import Run
from apps.runs.selectors import run_for_worker
from apps.teams.viewsets import WorkerViewSet
from workers import protocol


class WorkerQcViewSet(WorkerViewSet):
    def _run(self, run: str) -> Run:
        return run_for_worker(team_id=self.principal.team_id, run=run,
                              related=("environment_version__environment",))

    @extend_schema(request=protocol.QcReport, responses=protocol.QcResult)
    def create(self, request: Request, run: str) -> Response:
        obj = self._run(run)
        body = parse(protocol.QcReport, request.data)
        limits.check_json(body.report, field="report", limit=limits.REPORT_BYTES)
        version = services.report_qc(actor=self.actor, run=obj, lease_id=self.lease_id,
                                     report=body.report, uri=body.uri)
        return Response({"environment": version.environment.slug, "digest": version.digest,
                         "qc_status": version.qc_status})
