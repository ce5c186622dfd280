"""Executions: submit one or a batch (optionally waiting for results), fetch results."""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from typing import Any, cast

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import InvalidInput, NotFound, PayloadTooLarge
from apps.core.idempotency import idempotent
from apps.sandbox import services, sessions
from apps.sandbox.models import ACTIVE, Execution, SandboxSession, SandboxSnapshot
from apps.teams.viewsets import TeamScopedViewSet, WorkerViewSet

MAX_WAIT_S = 60
POLL_S = 0.05


class ExecutionSerializer(serializers.ModelSerializer):
    class Meta:
        model = Execution
        fields = ["id", "batch", "language", "status", "result", "error", "worker",
                  "created_at", "started_at", "finished_at"]
        read_only_fields = fields


def _wait_param(request: Request) -> float:
    raw = request.data.get("wait", 0) if isinstance(request.data, dict) else 0
    if not isinstance(raw, int | float) or isinstance(raw, bool) or not 0 <= raw <= MAX_WAIT_S:
        raise InvalidInput(f"wait must be a number of seconds between 0 and {MAX_WAIT_S}.",
                           details={"wait": [repr(raw)[:50]]})
    return float(raw)


def _wait_for(ids: list[uuid.UUID], seconds: float) -> list[Execution]:
    deadline = time.monotonic() + seconds
    while True:
        rows = {e.pk: e for e in Execution.objects.filter(pk__in=ids)}
        done = all(rows[i].status not in ACTIVE for i in ids)
        if done or time.monotonic() >= deadline:
            return [rows[i] for i in ids]
        time.sleep(POLL_S)


class ExecutionViewSet(TeamScopedViewSet):
    queryset = Execution.objects.all()
    serializer_class = ExecutionSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "execution"
    filterset_fields = {"status": ["exact"], "batch": ["exact"], "language": ["exact"]}
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(ExecutionSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, execution: str) -> Response:
        return Response(ExecutionSerializer(self.get_object()).data)

    @extend_schema(request=OpenApiTypes.OBJECT, responses={200: ExecutionSerializer,
                                                          202: ExecutionSerializer})
    def create(self, request: Request, team: str) -> Response:
        """Body: an execution request (language, code, stdin, limits, cases, tests, trace…)
        plus ``wait`` (seconds to wait for the result; 0 returns at once with 202)."""
        body = dict(request.data) if isinstance(request.data, dict) else None
        if body is None:
            raise InvalidInput("Send an execution request as a JSON object.")
        wait = _wait_param(request)
        body.pop("wait", None)
        parsed = services.validate_request(body)

        def handler() -> Response:
            rows = services.submit(actor=self.actor, team=self.team, requests=[parsed])
            return Response(ExecutionSerializer(rows[0]).data, status=status.HTTP_202_ACCEPTED)

        response = idempotent(request, handler)
        if wait and response.status_code == status.HTTP_202_ACCEPTED:
            done = _wait_for([uuid.UUID(str(response.data["id"]))], wait)[0]
            code = status.HTTP_200_OK if done.status not in ACTIVE else status.HTTP_202_ACCEPTED
            return Response(ExecutionSerializer(done).data, status=code)
        return response

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    @action(detail=False, methods=["post"])
    def batch(self, request: Request, team: str) -> Response:
        """Body: ``{"requests": [...], "wait": seconds}``; results come back in order."""
        body = request.data if isinstance(request.data, dict) else {}
        items = body.get("requests")
        if not isinstance(items, list) or not items:
            raise InvalidInput("A batch is {\"requests\": [execution request, ...]}.")
        limit = settings.CRUCIBLE["SANDBOX_MAX_BATCH"]
        if len(items) > limit:
            raise PayloadTooLarge(f"At most {limit} executions in one batch.")
        wait = _wait_param(request)
        parsed = [services.validate_request(item, i) for i, item in enumerate(items)]

        def handler() -> Response:
            rows = services.submit(actor=self.actor, team=self.team, requests=parsed)
            return Response({"batch": rows[0].batch, "results":
                             ExecutionSerializer(rows, many=True).data},
                            status=status.HTTP_202_ACCEPTED)

        response = idempotent(request, handler)
        if wait and response.status_code == status.HTTP_202_ACCEPTED:
            ids = [uuid.UUID(str(r["id"])) for r in response.data["results"]]
            rows = _wait_for(ids, wait)
            finished = all(r.status not in ACTIVE for r in rows)
            return Response({"batch": response.data["batch"],
                             "results": ExecutionSerializer(rows, many=True).data},
                            status=status.HTTP_200_OK if finished else status.HTTP_202_ACCEPTED)
        return response


class WorkerExecutionViewSet(WorkerViewSet):
    def _start_worker(self) -> str:
        return self.request.headers.get("X-Crucible-Worker", "") or self.principal.token.prefix

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def start(self, request: Request, execution: str) -> Response:
        try:
            execution_id = uuid.UUID(execution)
        except ValueError as exc:
            raise NotFound(f"No execution '{execution}'.") from exc
        row = services.start(execution_id=execution_id, worker=self._start_worker(),
                             team_id=self.principal.team_id,
                             holder=self.principal.token.prefix, actor=self.actor)
        return Response({"id": str(row.pk), "request": row.request, "lease_id": row.lease_id,
                         "lease_expires_at": row.lease_expires_at})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def result(self, request: Request, execution: str) -> Response:
        try:
            execution_id = uuid.UUID(execution)
        except ValueError as exc:
            raise NotFound(f"No execution '{execution}'.") from exc
        qs = Execution.objects.filter(pk=execution_id)
        if self.principal.team_id is not None:
            qs = qs.filter(team_id=self.principal.team_id)
        row = qs.first()
        if row is None:
            raise NotFound(f"No execution '{execution}'.")
        body = request.data if isinstance(request.data, dict) else {}
        result, error = body.get("result"), body.get("error", "")
        if (result is None) == (not error):
            raise InvalidInput("Send exactly one of 'result' (an object) or 'error' (text).")
        if result is not None and not isinstance(result, dict):
            raise InvalidInput("result must be an object.")

        def handler() -> Response:
            done = services.finish(execution=row, result=result, error=str(error)[:10_000],
                                   lease_id=self.lease_id, holder=self.principal.token.prefix,
                                   actor=self.actor)
            return Response({"status": done.status})

        return idempotent(request, handler)


class SessionSerializer(serializers.ModelSerializer):
    class Meta:
        model = SandboxSession
        fields = ["id", "state", "limits", "egress", "forked_from", "closed_reason", "execs",
                  "created_at", "closed_at"]
        read_only_fields = fields


class SnapshotSerializer(serializers.ModelSerializer):
    class Meta:
        model = SandboxSnapshot
        fields = ["id", "session", "bytes", "created_at"]
        read_only_fields = fields


def _body(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise InvalidInput("Send a JSON object.")
    return dict(request.data)


class SandboxSessionViewSet(TeamScopedViewSet):
    """Sandbox sessions: workspaces that live across calls, with snapshots and forks
    (docs/sandbox.md, Sessions). Every call is audited."""

    queryset = SandboxSession.objects.all()
    serializer_class = SessionSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "session"
    filterset_fields = {"state": ["exact"]}
    ordering = "-created_at"

    def _row(self) -> SandboxSession:
        return cast(SandboxSession, self.get_object())

    def _snapshot(self, value: object) -> SandboxSnapshot:
        snap = None
        with contextlib.suppress(ValueError, TypeError):
            snap = SandboxSnapshot.objects.filter(pk=uuid.UUID(str(value)), team=self.team,
                                                  dropped=False).first()
        if snap is None:
            raise NotFound(f"No snapshot '{value}' in team '{self.team.slug}'.")
        return snap

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(SessionSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, session: str) -> Response:
        return Response(SessionSerializer(self._row()).data)

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: SessionSerializer})
    def create(self, request: Request, team: str) -> Response:
        """Body: ``{"limits": {cpu_s, memory_mb, disk_mb, pids, wall_s, idle_s, ...},
        "egress": {"allow": ["pypi.org", "*.example.com:443"], ...}}`` (egress optional: a
        session without it has no network)."""
        body = _body(request)
        limits = sessions.validate_limits(body.get("limits"))
        egress = sessions.validate_egress(body.get("egress"))
        row = sessions.create_session(actor=self.actor, team=self.team, limits=limits,
                                      egress=egress)
        return Response(SessionSerializer(row).data, status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, team: str, session: str) -> Response:
        row = sessions.close_session(actor=self.actor, session=self._row())
        return Response(SessionSerializer(row).data)

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["post"])
    def exec(self, request: Request, team: str, session: str) -> Response:
        """Body: ``{"cmd", "timeout_s", "stdin", "env", "background", "output_bytes"}``."""
        req = sessions.validate_exec(_body(request))
        return Response(sessions.exec_in(actor=self.actor, session=self._row(),
                                         request=req))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get", "post"])
    def files(self, request: Request, team: str, session: str) -> Response:
        """GET ``?path=`` -> ``{"path", "data"}`` (base64); POST ``{"path", "data", "mode"}``."""
        row = self._row()
        if request.method == "POST":
            body = _body(request)
            return Response(sessions.write_file(actor=self.actor, session=row,
                                                path=body.get("path"), data=body.get("data"),
                                                mode=body.get("mode", 0o644)))
        path = request.query_params.get("path", "")
        data = sessions.read_file(session=row, path=path)
        return Response({"path": path, "data": base64.b64encode(data).decode()})

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"])
    def egress(self, request: Request, team: str, session: str) -> Response:
        """The egress proxy's decisions: ``{"policy", "decisions": [{"verdict", "method",
        "host", "port", "address", "rule", "reason", "bytes_up", "bytes_down"}], "stats"}``."""
        return Response(sessions.egress_log(session=self._row()))

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"], url_path="list")
    def listing(self, request: Request, team: str, session: str) -> Response:
        """``?path=`` -> ``{"entries": [{"name", "kind", "size"}]}``."""
        path = request.query_params.get("path", "")
        return Response({"path": path, "entries": sessions.list_dir(session=self._row(),
                                                                    path=path)})

    @extend_schema(request=None, responses={201: SnapshotSerializer})
    @action(detail=True, methods=["post"])
    def snapshot(self, request: Request, team: str, session: str) -> Response:
        snap = sessions.snapshot(actor=self.actor, session=self._row())
        return Response(SnapshotSerializer(snap).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=OpenApiTypes.OBJECT, responses=SessionSerializer)
    @action(detail=True, methods=["post"])
    def restore(self, request: Request, team: str, session: str) -> Response:
        """Body: ``{"snapshot": id}`` (a snapshot of this team)."""
        row = self._row()
        sessions.restore(actor=self.actor, session=row,
                         snap=self._snapshot(_body(request).get("snapshot")))
        return Response(SessionSerializer(row).data)

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: SessionSerializer})
    @action(detail=True, methods=["post"])
    def fork(self, request: Request, team: str, session: str) -> Response:
        """Body: ``{"snapshot": id (default: one taken now), "limits": {...}, "egress":
        {...} or null}`` -> a new session on that snapshot (limits and egress default to this
        session's)."""
        row = self._row()
        body = _body(request)
        snap = (self._snapshot(body["snapshot"]) if body.get("snapshot")
                else sessions.snapshot(actor=self.actor, session=row))
        limits = sessions.validate_limits(body.get("limits") or row.limits)
        egress = sessions.validate_egress(body.get("egress", row.egress))
        new = sessions.create_session(actor=self.actor, team=self.team, limits=limits,
                                      forked_from=snap, egress=egress)
        return Response(SessionSerializer(new).data, status=status.HTTP_201_CREATED)


class SandboxSnapshotViewSet(TeamScopedViewSet):
    queryset = SandboxSnapshot.objects.filter(dropped=False)
    serializer_class = SnapshotSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "snapshot"
    filterset_fields = {"session": ["exact"]}
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(SnapshotSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, snapshot: str) -> Response:
        return Response(SnapshotSerializer(self.get_object()).data)

    def destroy(self, request: Request, team: str, snapshot: str) -> Response:
        sessions.drop_snapshot(actor=self.actor, snap=cast(SandboxSnapshot, self.get_object()))
        return Response(status=status.HTTP_204_NO_CONTENT)
