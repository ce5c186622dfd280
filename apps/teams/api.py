"""Teams, members, and tokens."""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils.cache import add_never_cache_headers
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.actor import Actor
from apps.core.exceptions import Forbidden, NotFound
from apps.core.permissions import AuthenticatedOrThrottled
from apps.core.viewsets import TeamScopedViewSet
from apps.teams import selectors, services
from apps.teams.authentication import WorkerPrincipal
from apps.teams.models import ApiToken, Membership, Role, Team, TokenKind
from apps.teams.serializers import (
    MembershipCreateSerializer,
    MembershipSerializer,
    MembershipUpdateSerializer,
    TeamCreateSerializer,
    TeamSerializer,
    TeamUpdateSerializer,
    TokenCreatedSerializer,
    TokenCreateSerializer,
    TokenSerializer,
)


def secret_response(data: dict) -> Response:
    """A 201 carrying a secret shown once: no cache (browser, proxy) may keep a copy."""
    response = Response(data, status=status.HTTP_201_CREATED)
    add_never_cache_headers(response)
    return response


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Documents BearerTokenAuthentication in the OpenAPI schema."""

    target_class = "apps.teams.authentication.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):  # noqa: ANN001, ANN201
        return {"type": "http", "scheme": "bearer",
                "description": "A personal (crc_…) or worker (crw_…) API token."}


class UserOnly(AuthenticatedOrThrottled):
    """Authenticated as a person (session or personal token), not as a worker."""

    def has_permission(self, request: Request, view: object) -> bool:
        if isinstance(request.user, WorkerPrincipal):
            raise Forbidden("Worker tokens can only call /api/v1/worker/ endpoints.")
        return super().has_permission(request, view)


class MyTeamsViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Teams the caller belongs to; creating one makes the caller its owner."""

    permission_classes = [UserOnly]
    queryset = Team.objects.none()  # for the schema; get_queryset() scopes to the caller
    serializer_class = TeamSerializer
    ordering = "slug"
    pagination_class = None

    def get_queryset(self) -> QuerySet:
        return selectors.teams_for_user(self.request.user).order_by("slug")

    @extend_schema(request=TeamCreateSerializer, responses={201: TeamSerializer})
    def create(self, request: Request) -> Response:
        data = TeamCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        team = services.team_create(actor=Actor.of_user(request.user), **data.validated_data)
        team.my_role = Role.OWNER
        return Response(TeamSerializer(team).data, status=status.HTTP_201_CREATED)


class TeamViewSet(TeamScopedViewSet):
    method_roles = {"PATCH": Role.ADMIN}
    queryset = selectors.Team.objects.all()
    serializer_class = TeamSerializer
    team_field = "pk"
    lookup_field = "slug"
    lookup_url_kwarg = "team"

    def retrieve(self, request: Request, team: str) -> Response:
        obj = self.get_object()
        obj.my_role = self.membership.role
        return Response(TeamSerializer(obj).data)

    @extend_schema(request=TeamUpdateSerializer, responses=TeamSerializer)
    def partial_update(self, request: Request, team: str) -> Response:
        data = TeamUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.team_update(actor=self.actor, team=self.get_object(), **data.validated_data)
        obj.my_role = self.membership.role
        return Response(TeamSerializer(obj).data)


class MembershipViewSet(TeamScopedViewSet):
    method_roles = {"POST": Role.ADMIN, "PATCH": Role.ADMIN, "DELETE": Role.ADMIN}
    queryset = Membership.objects.select_related("user")
    serializer_class = MembershipSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    ordering = "created_at"
    pagination_class = None

    def list(self, request: Request, team: str) -> Response:
        rows = self.get_queryset().order_by("created_at")
        return Response({"results": MembershipSerializer(rows, many=True).data})

    def retrieve(self, request: Request, team: str, username: str) -> Response:
        return Response(MembershipSerializer(self.get_object()).data)

    @extend_schema(request=MembershipCreateSerializer, responses={201: MembershipSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = MembershipCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_add(
            actor=self.actor, team=self.team, **data.validated_data
        )
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=MembershipUpdateSerializer, responses=MembershipSerializer)
    def partial_update(self, request: Request, team: str, username: str) -> Response:
        data = MembershipUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_change_role(
            actor=self.actor, membership=self.get_object(), **data.validated_data
        )
        return Response(MembershipSerializer(membership).data)

    def destroy(self, request: Request, team: str, username: str) -> Response:
        services.membership_remove(actor=self.actor, membership=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class WorkerTokenViewSet(TeamScopedViewSet):
    """Team-scoped worker tokens, for a team that runs its own pool. Admins only."""

    method_roles = {m: Role.ADMIN for m in ("GET", "HEAD", "OPTIONS", "POST", "DELETE")}
    queryset = ApiToken.objects.filter(kind=TokenKind.WORKER)
    serializer_class = TokenSerializer
    lookup_field = "prefix"
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(TokenSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, prefix: str) -> Response:
        return Response(TokenSerializer(self.get_object()).data)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        token, raw = services.worker_token_create(
            actor=self.actor, team=self.team, **data.validated_data
        )
        token.token = raw
        return secret_response(TokenCreatedSerializer(token).data)

    def destroy(self, request: Request, team: str, prefix: str) -> Response:
        services.token_revoke(actor=self.actor, token=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class PersonalTokenViewSet(viewsets.GenericViewSet):
    """The caller's own personal tokens (not team-scoped: a token acts as its user)."""

    permission_classes = [UserOnly]
    queryset = ApiToken.objects.none()  # for the schema; get_queryset() scopes to the caller
    serializer_class = TokenSerializer
    lookup_field = "prefix"
    ordering = "-created_at"

    def get_queryset(self) -> QuerySet:
        return selectors.personal_tokens(self.request.user)

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(TokenSerializer(page, many=True).data)

    def retrieve(self, request: Request, prefix: str) -> Response:
        token = self.get_queryset().filter(prefix=prefix).first()
        if token is None:
            raise NotFound(f"No token '{prefix}'.")
        return Response(TokenSerializer(token).data)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request: Request) -> Response:
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        token, raw = services.personal_token_create(
            actor=Actor.of_user(request.user), user=request.user, **data.validated_data
        )
        token.token = raw
        return secret_response(TokenCreatedSerializer(token).data)

    def destroy(self, request: Request, prefix: str) -> Response:
        token = self.get_queryset().filter(prefix=prefix).first()
        if token is None:
            raise NotFound(f"No token '{prefix}'.")
        services.token_revoke(actor=Actor.of_user(request.user), token=token)
        return Response(status=status.HTTP_204_NO_CONTENT)
