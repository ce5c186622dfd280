"""``/api/v1/worker/alerts/…``: what the pools' beat and webhook task call (operator worker
tokens only: these touch every team's rules and deliveries)."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from apps.alerts import services
from apps.core.exceptions import Forbidden, NotFound
from apps.teams.viewsets import WorkerViewSet


class WorkerAlertViewSet(WorkerViewSet):
    def _operator(self, what: str) -> None:
        if self.principal.team_id is not None:
            raise Forbidden(f"Only operator worker tokens (not tied to a team) may {what}.")

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def evaluate(self, request: Request) -> Response:
        """Evaluate the periodic rules (queue wait, lost nodes) of every team and resend
        webhook deliveries whose task was lost (the beat calls it)."""
        self._operator("evaluate alert rules")
        return Response(services.evaluate_periodic())

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def attempt(self, request: Request, delivery: str) -> Response:
        """Make a webhook delivery's next attempt if it is due (the delivery task calls it);
        says whether to retry and when."""
        self._operator("deliver webhooks")
        if not delivery.isdigit():
            raise NotFound(f"No webhook delivery {delivery[:40]!r}.")
        return Response(services.attempt_delivery(delivery_id=int(delivery)))
