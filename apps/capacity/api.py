"""``GET /api/v1/teams/<team>/capacity/catalog``: the GPU types and model presets the planner
knows; ``POST …/capacity/plan``: a plan (memory, decode bandwidth, fitting TP/EP layouts)
for a model at a concurrency and context length. Computes, creates nothing: viewers may
call both."""

from __future__ import annotations

from typing import ClassVar

from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.capacity import selectors
from apps.capacity.serializers import CatalogSerializer, PlanRequestSerializer, PlanSerializer
from apps.runs.models import Checkpoint
from apps.teams.models import Role
from apps.teams.viewsets import TeamScopedViewSet
from workers.capacity import GPUS, PRESETS
from workers.capacity.plan import KV_BYTES, WEIGHT_BYTES


class CapacityViewSet(TeamScopedViewSet):
    # The team's checkpoints are what a plan may read a config from.
    queryset = Checkpoint.objects.all()
    serializer_class = PlanRequestSerializer  # what OPTIONS describes
    pagination_class = None
    method_roles: ClassVar[dict[str, str]] = {"POST": Role.VIEWER}

    @extend_schema(responses=CatalogSerializer)
    @action(detail=False, methods=["get"])
    def catalog(self, request: Request, team: str) -> Response:
        return Response({
            "gpus": [{"key": g.key, "name": g.name, "memory_bytes": g.memory_bytes,
                      "bandwidth_bytes_s": g.bandwidth_bytes_s} for g in GPUS.values()],
            "presets": PRESETS, "dtypes": list(WEIGHT_BYTES), "kv_dtypes": list(KV_BYTES)})

    @extend_schema(request=PlanRequestSerializer, responses={200: PlanSerializer})
    @action(detail=False, methods=["post"])
    def plan(self, request: Request, team: str) -> Response:
        """Weights per dtype, KV cache, prefill activations and decode bandwidth, and for
        each tensor-parallel size (with and without expert parallelism) the fewest GPUs of
        the chosen type that hold it; docs/capacity.md has the formulas."""
        data = PlanRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(selectors.capacity_plan(self.team, data.validated_data))
