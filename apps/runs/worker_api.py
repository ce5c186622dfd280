"""Endpoints the worker pools call: claim, heartbeat, status, and reports.

Every call after the claim carries the lease id (header ``X-Crucible-Lease``); a worker
whose lease expired or whose run was canceled gets a 409 and must stop.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import Forbidden, InvalidInput, PayloadTooLarge
from apps.core.idempotency import idempotent
from apps.core.viewsets import WorkerViewSet
from apps.runs import selectors, services
from apps.runs.models import Pool, Run
from apps.runs.serializers import CheckpointSerializer
from apps.sandbox import services as sandbox_services


class ClaimSerializer(serializers.Serializer):
    pool = serializers.ChoiceField(choices=Pool.choices)
    worker_id = serializers.CharField(max_length=200)
    run_id = serializers.UUIDField(required=False, allow_null=True, default=None)


class StatusSerializer(serializers.Serializer):
    status = serializers.CharField(max_length=32)
    error = serializers.CharField(max_length=limits.MESSAGE, required=False, allow_blank=True,
                                  default="")
    # With status failed: the error may pass on another attempt; queue the run again if it
    # has attempts left.
    retry = serializers.BooleanField(required=False, default=False)


MAX_STEP = 2**63 - 1  # steps are BIGINT columns


class CheckpointCreateSerializer(serializers.Serializer):
    step = serializers.IntegerField(min_value=0, max_value=MAX_STEP)
    uri = serializers.CharField(max_length=1000)
    metrics = serializers.DictField(required=False, default=dict)
    resumable = serializers.BooleanField(
        required=False, default=False,
        help_text="holds the training state a resume needs (a periodic checkpoint)")
    keep = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=1, max_value=10_000,
        help_text="then keep only the newest `keep` resumable checkpoints in the object store "
                  "(and any that lineage points to); the rest are pruned")

    def validate_metrics(self, value: dict) -> dict:
        return limits.check_json(value, field="metrics", limit=limits.SMALL_JSON_BYTES)


class SampleRowSerializer(serializers.Serializer):
    step = serializers.IntegerField(min_value=0, max_value=MAX_STEP)
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False,
                                   max_length=limits.SAMPLE_TEXT)
    completion = serializers.CharField(allow_blank=True, trim_whitespace=False,
                                       max_length=limits.SAMPLE_TEXT)
    reward = serializers.FloatField(required=False, allow_null=True, default=None)
    reward_components = serializers.DictField(child=serializers.FloatField(), required=False,
                                              default=dict)
    advantage = serializers.FloatField(required=False, allow_null=True, default=None)
    weight_version = serializers.IntegerField(required=False, allow_null=True, default=None,
                                              min_value=0, max_value=MAX_STEP)
    finish_reason = serializers.CharField(required=False, allow_blank=True, default="",
                                          max_length=32)

    def validate_reward_components(self, value: dict) -> dict:
        return limits.check_json(value, field="reward_components",
                                 limit=limits.SMALL_JSON_BYTES)


class ArtifactSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["report"])
    uri = serializers.CharField(max_length=1000)


class WorkerRunViewSet(WorkerViewSet):
    def _run(self, run: str, *, related: bool = True) -> Run:
        return selectors.run_for_worker(
            team_id=self.principal.team_id, run=run,
            related=("team", "project", "environment_version__environment") if related else (),
        )

    @extend_schema(request=ClaimSerializer, responses={200: OpenApiTypes.OBJECT, 204: None})
    def claim(self, request: Request) -> Response:
        data = ClaimSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        run = services.claim(actor=self.actor, pool=values["pool"], worker_id=values["worker_id"],
                             team_id=self.principal.team_id, run_id=values["run_id"])
        if run is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response(selectors.worker_view(self._run(str(run.pk))))

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def retrieve(self, request: Request, run: str) -> Response:
        return Response(selectors.worker_view(self._run(run)))

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def heartbeat(self, request: Request, run: str) -> Response:
        obj = services.heartbeat(run=self._run(run), lease_id=self.lease_id)
        return Response({"status": obj.status, "lease_expires_at": obj.lease_expires_at})

    @extend_schema(request=StatusSerializer, responses=OpenApiTypes.OBJECT)
    def status(self, request: Request, run: str) -> Response:
        data = StatusSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.worker_transition(actor=self.actor, run=self._run(run),
                                         lease_id=self.lease_id, to=data.validated_data["status"],
                                         error=data.validated_data["error"],
                                         retry=data.validated_data["retry"])
        return Response({"status": obj.status})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def metrics(self, request: Request, run: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        if "seq" not in body or "points" not in body:
            raise InvalidInput("A metric batch is {\"seq\": int, \"points\": [...]}.")
        stored, duplicate = services.ingest_metrics(
            run=self._run(run, related=False), lease_id=self.lease_id, seq=body["seq"],
            points=body["points"],
        )
        return Response({"stored": stored, "duplicate": duplicate})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def events(self, request: Request, run: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        rows = body.get("events")
        if not isinstance(rows, list) or not rows:
            raise InvalidInput("An event batch is {\"events\": [{\"message\", \"level\"?, "
                               "\"data\"?}]}.")
        if len(rows) > settings.CRUCIBLE["MAX_EVENT_BATCH"]:
            raise PayloadTooLarge(f"At most {settings.CRUCIBLE['MAX_EVENT_BATCH']} events a batch.")
        obj = self._run(run)

        def handler() -> Response:
            created = services.append_events(run=obj, lease_id=self.lease_id, rows=rows)
            return Response({"seqs": [e.seq for e in created]}, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(request=CheckpointCreateSerializer, responses=CheckpointSerializer)
    def checkpoints(self, request: Request, run: str) -> Response:
        data = CheckpointCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        ckpt, created = services.add_checkpoint(actor=self.actor, run=self._run(run),
                                                lease_id=self.lease_id,
                                                **data.validated_data)
        return Response(CheckpointSerializer(ckpt).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=SampleRowSerializer(many=True), responses=OpenApiTypes.OBJECT)
    def samples(self, request: Request, run: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        rows = body.get("samples")
        if not isinstance(rows, list) or not rows:
            raise InvalidInput("A sample batch is {\"samples\": [...]}.")
        if len(rows) > settings.CRUCIBLE["MAX_SAMPLE_BATCH"]:
            raise PayloadTooLarge(f"At most {settings.CRUCIBLE['MAX_SAMPLE_BATCH']} samples a "
                                  "batch.")
        data = SampleRowSerializer(data=rows, many=True)
        data.is_valid(raise_exception=True)
        obj = self._run(run)

        def handler() -> Response:
            count = services.add_samples(actor=self.actor, run=obj, lease_id=self.lease_id,
                                         rows=list(data.validated_data))
            return Response({"stored": count}, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(request=ArtifactSerializer, responses=OpenApiTypes.OBJECT)
    def artifacts(self, request: Request, run: str) -> Response:
        data = ArtifactSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.set_report(actor=self.actor, run=self._run(run), lease_id=self.lease_id,
                                  uri=data.validated_data["uri"])
        return Response({"report_uri": obj.report_uri})


class WorkerSweepViewSet(WorkerViewSet):
    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def sweep(self, request: Request) -> Response:
        """Requeue runs whose lease expired (called periodically by the pools' beat).
        Operator tokens only: it touches every team's runs."""
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may sweep.")
        swept = services.sweep_expired(actor=self.actor)
        lost = sandbox_services.sweep_lost()
        return Response({"requeued": [str(r.pk) for r in swept if r.status == "queued"],
                         "failed": [str(r.pk) for r in swept if r.status == "failed"],
                         "executions_lost": lost})
