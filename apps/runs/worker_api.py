"""Endpoints the worker pools call: claim, heartbeat, status, and reports.

Every call after the claim carries the lease id (header ``X-Crucible-Lease``); a worker
whose lease expired or whose run was canceled gets a 409 and must stop.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import Forbidden, InvalidInput, PayloadTooLarge
from apps.core.idempotency import idempotent
from apps.core.protocol import parse
from apps.filtering import services as filtering
from apps.filtering.models import Surface
from apps.metrics import services as metric_services
from apps.runs import admission, selectors, services
from apps.runs.leases import check_lease
from apps.runs.models import Run
from apps.runs.serializers import CheckpointSerializer
from apps.sandbox import services as sandbox_services
from apps.scheduling import services as scheduling_services
from apps.teams.viewsets import WorkerViewSet
from workers import protocol


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class WorkerRunViewSet(WorkerViewSet):
    def _run(self, run: str, *, related: bool = True) -> Run:
        return selectors.run_for_worker(
            team_id=self.principal.team_id, run=run,
            related=("team", "project", "environment_version__environment") if related else (),
        )

    @extend_schema(request=protocol.ClaimRequest,
                   responses={200: protocol.ClaimedRun, 204: None})
    def claim(self, request: Request) -> Response:
        body = parse(protocol.ClaimRequest, request.data)
        run = services.claim(actor=self.actor, pool=body.pool, worker_id=body.worker_id,
                             team_id=self.principal.team_id, run_id=body.run_id,
                             node=body.node)
        if run is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response(selectors.worker_view(self._run(str(run.pk))))

    @extend_schema(responses=protocol.ClaimedRun)
    def retrieve(self, request: Request, run: str) -> Response:
        return Response(selectors.worker_view(self._run(run)))

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def heartbeat(self, request: Request, run: str) -> Response:
        obj = services.heartbeat(run=self._run(run), lease_id=self.lease_id)
        body: dict[str, object] = {"status": obj.status,
                                   "lease_expires_at": obj.lease_expires_at}
        if obj.preempt_deadline_at is not None:
            # The scheduler needs the run's GPUs: checkpoint and stop before the deadline.
            body.update(stop="preempt", preempt_deadline_at=obj.preempt_deadline_at)
        return Response(body)

    @extend_schema(request=protocol.StatusChange, responses=OpenApiTypes.OBJECT)
    def status(self, request: Request, run: str) -> Response:
        body = parse(protocol.StatusChange, request.data)
        limits.check_text(body.error, field="error", limit=limits.MESSAGE)
        obj = services.worker_transition(actor=self.actor, run=self._run(run),
                                         lease_id=self.lease_id, to=body.status,
                                         error=body.error, retry=body.retry,
                                         cause=body.cause, node=body.node,
                                         toolchains={lang: h.model_dump() for lang, h
                                                     in body.toolchains.items()},
                                         drained=body.drained)
        return Response({"status": obj.status})

    @extend_schema(request=protocol.AttemptStart, responses=OpenApiTypes.OBJECT)
    def started(self, request: Request, run: str) -> Response:
        """The current attempt's startup is over and its work begins (for goodput)."""
        body = parse(protocol.AttemptStart, request.data)
        attempt = services.attempt_started(run=self._run(run, related=False),
                                           lease_id=self.lease_id,
                                           resume_step=body.resume_step)
        return Response({"attempt": attempt.number, "started_at": attempt.started_at,
                         "resume_step": attempt.resume_step})

    @extend_schema(request=protocol.MetricBatch, responses=OpenApiTypes.OBJECT)
    def metrics(self, request: Request, run: str) -> Response:
        """A batch is ``{"seq", "points": [{"name", "step", "value", "wall_time"?}]}`` or,
        cheaper to send and check, ``{"seq", "columns": {"name": [...], "step": [...],
        "value": [...], "wall_time"?: [...]}}``; as JSON or msgpack (``Content-Type:
        application/msgpack``). The metric service validates it before it takes the lock;
        the run is found and locked in one query."""
        body = request.data if isinstance(request.data, dict) else {}
        if "seq" not in body or ("points" not in body and "columns" not in body):
            raise InvalidInput("A metric batch is {\"seq\": int, \"points\": [...]} or "
                               "{\"seq\": int, \"columns\": {\"name\": [...], \"step\": "
                               "[...], \"value\": [...], \"wall_time\"?: [...]}}.")
        stored, duplicate = services.ingest_metrics(
            run=run, team_id=self.principal.team_id, lease_id=self.lease_id, seq=body["seq"],
            points=body.get("points"), columns=body.get("columns"),
        )
        return Response({"stored": stored, "duplicate": duplicate})

    @extend_schema(request=protocol.EventBatch, responses=OpenApiTypes.OBJECT)
    def events(self, request: Request, run: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        raw = body.get("events")
        if not isinstance(raw, list) or not raw:
            raise InvalidInput("An event batch is {\"events\": [{\"message\", \"level\"?, "
                               "\"data\"?}]}.")
        if len(raw) > settings.CRUCIBLE["MAX_EVENT_BATCH"]:
            raise PayloadTooLarge(f"At most {settings.CRUCIBLE['MAX_EVENT_BATCH']} events a batch.")
        rows = [e.model_dump() for e in parse(protocol.EventBatch, body).events]
        obj = self._run(run)

        def handler() -> Response:
            created = services.append_events(run=obj, lease_id=self.lease_id, rows=rows)
            return Response({"seqs": [e.seq for e in created]}, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(request=protocol.CheckpointReport, responses=CheckpointSerializer)
    def checkpoints(self, request: Request, run: str) -> Response:
        body = parse(protocol.CheckpointReport, request.data)
        limits.check_json(body.metrics, field="metrics", limit=limits.SMALL_JSON_BYTES)
        ckpt, created = services.add_checkpoint(actor=self.actor, run=self._run(run),
                                                lease_id=self.lease_id, **body.model_dump())
        return Response(CheckpointSerializer(ckpt).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=protocol.SampleBatch, responses=OpenApiTypes.OBJECT)
    def samples(self, request: Request, run: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        rows = body.get("samples")
        if not isinstance(rows, list) or not rows:
            raise InvalidInput("A sample batch is {\"samples\": [...]}.")
        if len(rows) > settings.CRUCIBLE["MAX_SAMPLE_BATCH"]:
            raise PayloadTooLarge(f"At most {settings.CRUCIBLE['MAX_SAMPLE_BATCH']} samples a "
                                  "batch.")
        samples = [s.model_dump() for s in parse(protocol.SampleBatch, body).samples]
        for i, sample in enumerate(samples):
            for field in ("prompt", "completion"):
                limits.check_text(sample[field], field=f"samples[{i}].{field}",
                                  limit=limits.SAMPLE_TEXT)
            limits.check_json(sample["reward_components"],
                              field=f"samples[{i}].reward_components",
                              limit=limits.SMALL_JSON_BYTES)
        obj = self._run(run)
        # Before the idempotent write: a blocked batch is refused (422) and its refusal stays
        # logged; flagged or redacted rows are stored with their findings. A stale lease is
        # refused first (the write checks it again, under the row lock).
        check_lease(obj, self.lease_id)
        screened = filtering.screen_rows(team_id=obj.team_id, surface=Surface.SAMPLES,
                                         rows=samples, fields=("prompt", "completion"),
                                         target=("run", obj.pk))

        def handler() -> Response:
            count = services.add_samples(actor=self.actor, run=obj, lease_id=self.lease_id,
                                         rows=screened.rows, flags=screened.hits,
                                         filter_mode=screened.mode)
            return Response({"stored": count}, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(request=protocol.ReportArtifact, responses=OpenApiTypes.OBJECT)
    def artifacts(self, request: Request, run: str) -> Response:
        body = parse(protocol.ReportArtifact, request.data)
        obj = services.set_report(actor=self.actor, run=self._run(run), lease_id=self.lease_id,
                                  uri=body.uri)
        return Response({"report_uri": obj.report_uri})


class WorkerSweepViewSet(WorkerViewSet):
    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def sweep(self, request: Request) -> Response:
        """Requeue runs whose lease expired and mark nodes that stopped heartbeating
        ``lost`` (called periodically by the pools' beat). Operator tokens only: it touches
        every team's runs."""
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may sweep.")
        swept = services.sweep_expired(actor=self.actor)
        lost = sandbox_services.sweep_lost()
        nodes_lost = scheduling_services.sweep_lost_nodes()
        return Response({"requeued": [str(r.pk) for r in swept if r.status == "queued"],
                         "failed": [str(r.pk) for r in swept if r.status == "failed"],
                         "executions_lost": lost, "nodes_lost": nodes_lost})

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def prune_metrics(self, request: Request) -> Response:
        """Drop raw metric points past each team's retention (called periodically by the
        pools' beat); rollups stay. Operator tokens only, like the sweep."""
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may prune "
                            "metrics.")
        return Response({"dropped": metric_services.prune_raw_points()})

    @extend_schema(request=protocol.DeadLeaseReport, responses=OpenApiTypes.OBJECT)
    def dead_leases(self, request: Request, name: str) -> Response:
        """A node agent reports leases whose worker process died on its host: their runs are
        requeued at once. Operator tokens only, like the node's own endpoints."""
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may report a "
                            "node's dead workers.")
        body = parse(protocol.DeadLeaseReport, request.data)
        if body.leases and any(not _is_uuid(lease.run) for lease in body.leases):
            raise InvalidInput("Each lease names its run by id.", details={"leases": ["run"]})
        released, ignored = services.release_dead_leases(
            actor=self.actor, node=name, leases=[lease.model_dump() for lease in body.leases])
        return Response({"released": released, "ignored": ignored})

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def admission(self, request: Request) -> Response:
        """One admission pass (the beat calls it with ``CRUCIBLE_SCHEDULER`` on). Operator
        tokens only, like the sweep."""
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may run the "
                            "admission pass.")
        return Response(admission.admission_pass())
