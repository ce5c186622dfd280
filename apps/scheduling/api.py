"""``/api/v1/cluster/nodes``: the cluster's inventory. Any signed-in person may read it (it
says how much capacity exists and why a node takes no work, nothing about any team's runs);
only staff may cordon, drain or uncordon a node. Not team-scoped: nodes belong to the
cluster (tests/apps/api/test_urlconf.py allow-lists these routes)."""

from __future__ import annotations

from typing import Any, ClassVar

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.actor import Actor
from apps.core.exceptions import Forbidden
from apps.core.pagination import CursorPagination
from apps.core.serializers import StrictSerializer
from apps.scheduling import queues, selectors, services
from apps.scheduling.models import Node, NodeTransition, Queue
from apps.teams.api import UserOnly
from apps.teams.models import Role
from apps.teams.viewsets import TeamScopedViewSet

NODE_NAME_REGEX = r"[A-Za-z0-9][A-Za-z0-9._-]*"


class NodeTransitionSerializer(serializers.ModelSerializer):
    class Meta:
        model = NodeTransition
        fields = ["from_state", "to_state", "reason", "actor", "at"]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):
    heartbeat_age_s = serializers.SerializerMethodField(
        help_text="seconds since the node's agent last reported")

    class Meta:
        model = Node
        fields = ["name", "pool", "gpu_type", "gpu_count", "cpus", "memory_mb", "labels",
                  "agent_version", "state", "state_reason", "registered_at",
                  "last_heartbeat_at", "heartbeat_age_s", "consecutive_infra_failures",
                  "toolchains", "recheck"]
        read_only_fields = fields

    def get_heartbeat_age_s(self, node: Node) -> int:
        return selectors.heartbeat_age_s(node)


class NodeDetailSerializer(NodeSerializer):
    history = serializers.SerializerMethodField(help_text="latest transitions, newest first")

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "history"]
        read_only_fields = fields

    @extend_schema_field(NodeTransitionSerializer(many=True))
    def get_history(self, node: Node) -> list[dict[str, Any]]:
        return list(NodeTransitionSerializer(selectors.history(node), many=True).data)


class NodeReasonSerializer(StrictSerializer):
    """Cordon and drain say why: the reason is shown on the cluster page and kept in the
    node's history."""

    reason = serializers.CharField(max_length=services.REASON_MAX,
                                   help_text="why the node takes no new work")


class NodeUncordonSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=services.REASON_MAX, required=False,
                                   allow_blank=True, default="", help_text="optional note")


class NodeCursor(CursorPagination):
    ordering = "name"


class NodeViewSet(viewsets.GenericViewSet):
    """Nodes, by name. ``POST …/<name>/cordon|drain|uncordon`` with ``{"reason": …}``."""

    permission_classes: ClassVar[list] = [UserOnly]
    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    pagination_class = NodeCursor
    lookup_field = "name"
    lookup_value_regex = NODE_NAME_REGEX
    filter_backends: ClassVar[list] = []

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(selectors.nodes())
        return self.get_paginated_response(NodeSerializer(page, many=True).data)

    @extend_schema(responses=NodeDetailSerializer)
    def retrieve(self, request: Request, name: str) -> Response:
        return Response(NodeDetailSerializer(selectors.node(name)).data)

    def _act(self, request: Request, name: str, verb: str) -> Response:
        if not (request.user.is_staff or request.user.is_superuser):
            raise Forbidden(f"Only staff may {verb} nodes; ask a cluster operator. Anyone "
                            "signed in may read the inventory.")
        node = selectors.node(name)  # 404 before the body is judged
        body = (NodeUncordonSerializer if verb == "uncordon" else NodeReasonSerializer)(
            data=request.data)
        body.is_valid(raise_exception=True)
        act = {"cordon": services.cordon, "drain": services.drain,
               "uncordon": services.uncordon}[verb]
        changed = act(actor=Actor.of_user(request.user), node=node,
                      reason=body.validated_data["reason"])
        return Response(NodeDetailSerializer(changed).data)

    @extend_schema(request=NodeReasonSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, name: str) -> Response:
        """Take no new work; runs already there continue."""
        return self._act(request, name, "cordon")

    @extend_schema(request=NodeReasonSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, name: str) -> Response:
        """Take no new work and empty the node (maintenance)."""
        return self._act(request, name, "drain")

    @extend_schema(request=NodeUncordonSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, name: str) -> Response:
        """Back to ready."""
        return self._act(request, name, "uncordon")


class QueueSerializer(StrictSerializer):
    """A team's queue (workers.scheduling.spec.QueueSpec); quotas per flavor: a GPU type
    counts GPUs, ``cpu`` counts cores. Limits left out (null) mean no limit."""

    cohort = serializers.CharField(max_length=128, required=False, allow_blank=True,
                                   allow_null=True, default=None)
    nominal = serializers.DictField(child=serializers.FloatField(), default=dict)
    borrowing_limit = serializers.DictField(child=serializers.FloatField(), required=False,
                                            allow_null=True, default=None)
    lending_limit = serializers.DictField(child=serializers.FloatField(), required=False,
                                          allow_null=True, default=None)
    default_priority = serializers.CharField(max_length=64, default="default")


def queue_view(team: Any) -> dict[str, Any]:
    """The team's queue as the scheduler uses it; ``configured`` is false for the default
    queue (the whole cluster as nominal quota, no cohort)."""
    row = queues.queue_row(team.pk)
    spec = queues.team_spec(team.pk, team.slug)
    return {"team": team.slug, "configured": row is not None, "cohort": spec.cohort,
            "nominal": spec.nominal, "borrowing_limit": spec.borrowing_limit,
            "lending_limit": spec.lending_limit, "default_priority": spec.default_priority,
            "updated_at": row.updated_at if row is not None else None}


class TeamQueueViewSet(TeamScopedViewSet):
    """``/api/v1/teams/<team>/queue``: members read their team's queue; only staff set it
    (quota is the cluster operator's to share out)."""

    queryset = Queue.objects.all()
    method_roles: ClassVar[dict[str, str]] = {"PUT": Role.VIEWER}
    # No OPTIONS metadata: DRF's would look the PUT target up by a `pk` this one-per-team
    # route does not have (a 500 the API fuzzer found); OPTIONS is simply not allowed (405).
    metadata_class = None

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def retrieve(self, request: Request, team: str) -> Response:
        return Response(queue_view(self.team))

    @extend_schema(request=QueueSerializer, responses=OpenApiTypes.OBJECT)
    def update(self, request: Request, team: str) -> Response:
        if not (request.user.is_staff or request.user.is_superuser):
            raise Forbidden("Only staff may set a team's queue; ask a cluster operator.")
        body = QueueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.set_queue(actor=self.actor, team_id=self.team.pk, **body.validated_data)
        return Response(queue_view(self.team))
