from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import InvalidInput
from apps.lineage import selectors
from apps.lineage.models import ArtifactType, LineageEdge
from apps.teams.viewsets import TeamScopedViewSet


class LineageViewSet(TeamScopedViewSet):
    """``GET ?artifact=<type>:<id>`` → the graph around one artifact."""

    queryset = LineageEdge.objects.all()
    pagination_class = None

    @extend_schema(
        parameters=[OpenApiParameter("artifact", OpenApiTypes.STR, required=True,
                                     description="e.g. run:<uuid> or dataset_version:<digest>")],
        responses=OpenApiTypes.OBJECT,
    )
    def list(self, request: Request, team: str) -> Response:
        raw = request.query_params.get("artifact", "")
        kind, _, ident = raw.partition(":")
        if kind not in ArtifactType.values or not ident:
            raise InvalidInput(
                f"artifact must be <type>:<id> with type one of {', '.join(ArtifactType.values)}.",
                details={"artifact": [raw or "missing"]},
            )
        return Response(selectors.graph(team_id=self.team.pk, artifact_type=kind,
                                        artifact_id=ident))
