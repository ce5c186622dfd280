"""The worker side: a synthesize run hands its result (records + manifest) over as a batch
for review, under its lease, so the accepted version links back to the run."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import InvalidInput
from apps.core.idempotency import idempotent
from apps.core.viewsets import WorkerViewSet
from apps.datasets.models import Dataset
from apps.review import services
from apps.review.api import BatchCreateSerializer, BatchSerializer
from apps.review.models import Batch
from apps.review.selectors import with_counts
from apps.runs.models import Run
from apps.runs.selectors import run_for_worker


class WorkerBatchSerializer(BatchCreateSerializer):
    run = None  # the run is the one in the URL


class WorkerBatchViewSet(WorkerViewSet):
    def _run(self, run: str) -> Run:
        return run_for_worker(team_id=self.principal.team_id, run=run, related=("team",))

    @extend_schema(request=WorkerBatchSerializer, responses={201: BatchSerializer})
    def create(self, request: Request, run: str) -> Response:
        obj = self._run(run)
        return idempotent(request, lambda: self._create(request, obj))

    def _create(self, request: Request, run: Run) -> Response:
        data = WorkerBatchSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        dataset = Dataset.objects.filter(team_id=run.team_id, slug=values["dataset"]).first()
        if dataset is None:
            raise InvalidInput(f"No dataset '{values['dataset']}' in the run's team.",
                               details={"dataset": [values["dataset"]]})
        batch = services.batch_from_run(
            actor=self.actor, run=run, lease_id=self.lease_id, dataset=dataset,
            records=values["records"], manifest=values["manifest"], trails=values["trails"],
            name=values["name"], target_error_rate=values["target_error_rate"],
            confidence=values["confidence"], sample_seed=values["sample_seed"],
        )
        batch = with_counts(Batch.objects.filter(pk=batch.pk)).get()
        return Response(BatchSerializer(batch).data, status=status.HTTP_201_CREATED)
