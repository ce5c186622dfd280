"""The node agents' endpoints under ``/api/v1/worker/nodes/``: register (at every agent
start) and heartbeat. Operator worker tokens only: a node serves the whole cluster, so a
team's worker token may not add capacity or speak for a host."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import Forbidden
from apps.core.protocol import parse
from apps.scheduling import services
from apps.scheduling.models import Node
from apps.teams.viewsets import WorkerViewSet
from workers import protocol


def node_status(node: Node) -> dict[str, Any]:
    return protocol.NodeStatus.model_validate(
        {"name": node.name, "state": node.state, "state_reason": node.state_reason,
         "recheck": node.recheck}).model_dump()


class WorkerNodeViewSet(WorkerViewSet):
    def _operator_only(self) -> None:
        if self.principal.team_id is not None:
            raise Forbidden("Only operator worker tokens (not tied to a team) may register "
                            "nodes or heartbeat for them: a node serves every team. Create "
                            "one with `python manage.py create_worker_token` (no --team).")

    @extend_schema(request=protocol.NodeRegistration,
                   responses={200: protocol.NodeStatus, 201: protocol.NodeStatus})
    def register(self, request: Request) -> Response:
        self._operator_only()
        body = parse(protocol.NodeRegistration, request.data)
        node, created = services.register_node(actor=self.actor, registration=body)
        return Response(node_status(node),
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=protocol.NodeHeartbeat, responses=protocol.NodeStatus)
    def heartbeat(self, request: Request, name: str) -> Response:
        self._operator_only()
        body = parse(protocol.NodeHeartbeat, request.data)
        found = {lang: h.model_dump() for lang, h in body.toolchains.items()}
        return Response(node_status(services.heartbeat(name=name, toolchains=found)))
