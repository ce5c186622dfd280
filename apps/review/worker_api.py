"""The worker side: a synthesize run hands its result (records + manifest) over as a batch
for review, under its lease, so the accepted version links back to the run."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.core.idempotency import idempotent
from apps.core.protocol import parse
from apps.datasets.models import Dataset
from apps.review import services
from apps.review.api import BatchSerializer
from apps.review.models import Batch
from apps.review.selectors import with_counts
from apps.runs.models import Run
from apps.runs.selectors import run_for_worker
from apps.teams.viewsets import WorkerViewSet
from workers import protocol


class WorkerBatchViewSet(WorkerViewSet):
    def _run(self, run: str) -> Run:
        return run_for_worker(team_id=self.principal.team_id, run=run, related=("team",))

    @extend_schema(request=protocol.BatchHandOver, responses={201: BatchSerializer})
    def create(self, request: Request, run: str) -> Response:
        obj = self._run(run)
        return idempotent(request, lambda: self._create(request, obj))

    def _create(self, request: Request, run: Run) -> Response:
        body = parse(protocol.BatchHandOver, request.data)
        limits.check_json(body.manifest, field="manifest", limit=limits.MANIFEST_BYTES)
        dataset = Dataset.objects.filter(team_id=run.team_id, slug=body.dataset).first()
        if dataset is None:
            raise InvalidInput(f"No dataset '{body.dataset}' in the run's team.",
                               details={"dataset": [body.dataset]})
        batch = services.batch_from_run(
            actor=self.actor, run=run, lease_id=self.lease_id, dataset=dataset,
            records=body.records, manifest=body.manifest, trails=body.trails, name=body.name,
            target_error_rate=body.target_error_rate, confidence=body.confidence,
            sample_seed=body.sample_seed,
        )
        batch = with_counts(Batch.objects.filter(pk=batch.pk)).get()
        return Response(BatchSerializer(batch).data, status=status.HTTP_201_CREATED)
