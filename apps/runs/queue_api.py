"""``/api/v1/cluster/queue``: what waits for the cluster, queue by queue, and why. Lives in
runs (it reads runs; apps.scheduling may not import apps.runs). Anyone signed in sees every
queue's counts; the runs listed are those of the caller's teams (all of them for staff)."""

from __future__ import annotations

from typing import ClassVar

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.runs import scheduler, selectors
from apps.teams.api import UserOnly
from apps.teams.models import Membership


class ClusterQueueView(APIView):
    permission_classes: ClassVar[list] = [UserOnly]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        user = request.user
        visible = None if (user.is_staff or user.is_superuser) else set(
            Membership.objects.filter(user=user).values_list("team_id", flat=True))
        return Response({"scheduler": scheduler.enabled(),
                         "queues": selectors.pending_by_queue(visible)})
