"""Base viewsets: the only place tenant scoping and role checks happen.

``TeamScopedViewSet`` resolves ``<team>`` from the URL before any handler runs, answers
404 to non-members (the same as a missing team), checks the caller's role for the HTTP
method, and filters every queryset by that team. Subclasses cannot override the methods
that do this: ``__init_subclass__`` refuses them at import time.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Model, QuerySet
from rest_framework import viewsets
from rest_framework.request import Request

from apps.core.actor import Actor
from apps.core.exceptions import Forbidden, NotFound
from apps.teams.access import access_team
from apps.teams.authentication import WorkerPrincipal
from apps.teams.models import Membership, Role, Team, role_at_least

_LOCKED = ("initial", "get_queryset", "get_object", "check_team_access")

DEFAULT_METHOD_ROLES: dict[str, str] = {
    "GET": Role.VIEWER,
    "HEAD": Role.VIEWER,
    "OPTIONS": Role.VIEWER,
    "POST": Role.MEMBER,
    "PUT": Role.MEMBER,
    "PATCH": Role.MEMBER,
    "DELETE": Role.MEMBER,
}


class TeamScopedViewSet(viewsets.GenericViewSet):
    """Base for every view under ``/api/v1/teams/<team>/``."""

    team_scoped: ClassVar[bool] = True
    #: Minimum role per HTTP method; override entries per viewset.
    method_roles: ClassVar[dict[str, str]] = {}
    #: Minimum role per action name, checked after the method rule (e.g. admin-only actions).
    action_roles: ClassVar[dict[str, str]] = {}
    #: Path from the model to its team, for querysets that do not have ``team`` directly.
    team_field: ClassVar[str] = "team"

    team: Team
    membership: Membership

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _LOCKED:
            # getattr, not cls.__dict__: a mixin earlier in the MRO overrides just as well.
            if getattr(cls, name) is not getattr(TeamScopedViewSet, name):
                raise TypeError(
                    f"{cls.__name__} overrides {name}(); tenant scoping lives only in "
                    "TeamScopedViewSet. Override base_queryset() instead."
                )

    # --- locked -----------------------------------------------------------------------
    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        self.check_team_access(request)

    def check_team_access(self, request: Request) -> None:
        if isinstance(request.user, WorkerPrincipal):
            raise Forbidden("Worker tokens can only call /api/v1/worker/ endpoints.")
        team, membership = access_team(request.user, self.kwargs["team"])
        self.team, self.membership = team, membership
        required = {**DEFAULT_METHOD_ROLES, **self.method_roles}.get(request.method, Role.ADMIN)
        required = self.action_roles.get(getattr(self, "action", "") or "", required)
        if not role_at_least(membership.role, required):
            raise Forbidden(
                f"This needs the '{required}' role in team '{team.slug}'; "
                f"you are '{membership.role}'."
            )

    def get_queryset(self) -> QuerySet:
        queryset = self.base_queryset()
        return queryset.filter(**{self.team_field: self.team.pk})

    def get_object(self) -> Model:
        queryset = self.filter_queryset(self.get_queryset())
        lookup_url_kwarg = self.lookup_url_kwarg or self.lookup_field
        value = self.kwargs[lookup_url_kwarg]
        try:
            obj = queryset.filter(**{self.lookup_field: value}).first()
        except (ValueError, DjangoValidationError):  # e.g. "abc" where a UUID is expected
            obj = None
        if obj is None:
            noun = queryset.model._meta.verbose_name
            raise NotFound(f"No {noun} '{value}' in team '{self.team.slug}'.")
        self.check_object_permissions(self.request, obj)
        return obj

    # --- for subclasses ---------------------------------------------------------------
    def base_queryset(self) -> QuerySet:
        assert self.queryset is not None, f"{type(self).__name__} needs a queryset"
        return self.queryset.all()

    @property
    def actor(self) -> Actor:
        return Actor.of_user(self.request.user)


class WorkerViewSet(viewsets.GenericViewSet):
    """Base for ``/api/v1/worker/``: only worker tokens; a team's worker token sees only
    that team's runs, an operator's (team-less) token sees all."""

    worker_scoped: ClassVar[bool] = True
    pagination_class = None
    filter_backends: ClassVar[list] = []
    # No OPTIONS metadata: these views have no single serializer to describe, and DRF's
    # metadata would fail looking for one (a 500); OPTIONS is simply not allowed (405).
    metadata_class = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.initial is not WorkerViewSet.initial:
            raise TypeError(f"{cls.__name__} overrides initial(); worker auth lives in the base.")

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if not isinstance(request.user, WorkerPrincipal):
            raise Forbidden("Worker endpoints need a worker token (crw_…).")
        self.principal: WorkerPrincipal = request.user

    @property
    def actor(self) -> Actor:
        worker_id = self.request.headers.get("X-Crucible-Worker", "")
        return Actor.of_worker(self.principal.token.prefix, worker_id)

    @property
    def lease_id(self) -> str:
        return self.request.headers.get("X-Crucible-Lease", "")
