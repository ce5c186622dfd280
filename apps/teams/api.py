"""Teams, members and tokens, and ``/api/v1/me``: the caller and the teams they are in."""

from __future__ import annotations

from typing import cast

from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.cache import add_never_cache_headers
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.actor import Actor
from apps.core.exceptions import Forbidden, NotFound
from apps.core.permissions import AuthenticatedOrThrottled
from apps.core.throttles import AuthFailureThrottle, client_ip
from apps.teams import selectors, services
from apps.teams.authentication import WorkerPrincipal
from apps.teams.models import ApiToken, Invitation, Membership, Role, Team, TokenKind
from apps.teams.serializers import (
    InvitationAcceptedSerializer,
    InvitationAcceptSerializer,
    InvitationCreatedSerializer,
    InvitationCreateSerializer,
    InvitationSerializer,
    MembershipSerializer,
    MembershipUpdateSerializer,
    TeamCreateSerializer,
    TeamSerializer,
    TeamUpdateSerializer,
    TokenCreatedSerializer,
    TokenCreateSerializer,
    TokenSerializer,
)
from apps.teams.viewsets import TeamScopedViewSet


def secret_response(data: dict) -> Response:
    """A 201 carrying a secret shown once: no cache (browser, proxy) may keep a copy."""
    response = Response(data, status=status.HTTP_201_CREATED)
    add_never_cache_headers(response)
    return response


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Documents BearerTokenAuthentication in the OpenAPI schema."""

    target_class = "apps.teams.authentication.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "A personal (crc_…) or worker (crw_…) API token."}


class UserOnly(AuthenticatedOrThrottled):
    """Authenticated as a person (session or personal token), not as a worker."""

    def has_permission(self, request: Request, view: object) -> bool:
        if isinstance(request.user, WorkerPrincipal):
            raise Forbidden("Worker tokens can only call /api/v1/worker/ endpoints.")
        return super().has_permission(request, view)


class MeView(APIView):
    """The caller's identity: a worker token and its team, or a user and their teams."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        if isinstance(request.user, WorkerPrincipal):
            token = request.user.token
            return Response({"kind": "worker", "token": token.prefix,
                             "team": token.team.slug if token.team else None})
        teams = selectors.teams_for_user(request.user).order_by("slug")
        return Response({
            "kind": "user",
            "username": request.user.username,
            "teams": [{"slug": t.slug, "name": t.name, "role": getattr(t, "my_role", None)}
                      for t in teams],
        })


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
        team.my_role = Role.OWNER  # type: ignore[attr-defined]  # read by TeamSerializer
        return Response(TeamSerializer(team).data, status=status.HTTP_201_CREATED)


class TeamViewSet(TeamScopedViewSet):
    method_roles = {"PATCH": Role.ADMIN}
    queryset = selectors.Team.objects.all()
    serializer_class = TeamSerializer
    team_field = "pk"
    lookup_field = "slug"
    lookup_url_kwarg = "team"

    def retrieve(self, request: Request, team: str) -> Response:
        obj = cast(Team, self.get_object())
        obj.my_role = self.membership.role  # type: ignore[attr-defined]
        return Response(TeamSerializer(obj).data)

    @extend_schema(request=TeamUpdateSerializer, responses=TeamSerializer)
    def partial_update(self, request: Request, team: str) -> Response:
        data = TeamUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.team_update(actor=self.actor, team=cast(Team, self.get_object()),
                                   **data.validated_data)
        obj.my_role = self.membership.role  # type: ignore[attr-defined]
        return Response(TeamSerializer(obj).data)


class MembershipViewSet(TeamScopedViewSet):
    """The team's members. People join through invitations (``…/invitations``), never by
    an admin naming a username, so no team URL says whether a username exists."""

    method_roles = {"PATCH": Role.ADMIN, "DELETE": Role.ADMIN}
    queryset = Membership.objects.select_related("user")
    serializer_class = MembershipSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    ordering = "created_at"
    ordering_fields = ["created_at"]

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(MembershipSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, username: str) -> Response:
        return Response(MembershipSerializer(self.get_object()).data)

    @extend_schema(request=MembershipUpdateSerializer, responses=MembershipSerializer)
    def partial_update(self, request: Request, team: str, username: str) -> Response:
        data = MembershipUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_change_role(
            actor=self.actor, membership=cast(Membership, self.get_object()),
            **data.validated_data
        )
        return Response(MembershipSerializer(membership).data)

    def destroy(self, request: Request, team: str, username: str) -> Response:
        services.membership_remove(actor=self.actor,
                                   membership=cast(Membership, self.get_object()))
        return Response(status=status.HTTP_204_NO_CONTENT)


class InvitationViewSet(TeamScopedViewSet):
    """Invite codes to join the team, for its admins: create (the code is shown once),
    list, revoke."""

    method_roles = {m: Role.ADMIN for m in ("GET", "HEAD", "OPTIONS", "POST", "DELETE")}
    queryset = Invitation.objects.select_related("team", "created_by")
    serializer_class = InvitationSerializer
    lookup_field = "prefix"
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(InvitationSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, prefix: str) -> Response:
        return Response(InvitationSerializer(self.get_object()).data)

    @extend_schema(request=InvitationCreateSerializer,
                   responses={201: InvitationCreatedSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = InvitationCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        invitation, code = services.invitation_create(
            actor=self.actor, team=self.team, role=values["role"],
            hours=values["expires_in_hours"], max_uses=values["max_uses"])
        invitation.code = code
        return secret_response(InvitationCreatedSerializer(invitation).data)

    def destroy(self, request: Request, team: str, prefix: str) -> Response:
        services.invitation_revoke(actor=self.actor,
                                   invitation=cast(Invitation, self.get_object()))
        return Response(status=status.HTTP_204_NO_CONTENT)


class InvitationAcceptView(APIView):
    """``POST /api/v1/invitations/accept {"code": "cri_…"}``: join the code's team."""

    permission_classes = [UserOnly]

    @extend_schema(request=InvitationAcceptSerializer,
                   responses={201: InvitationAcceptedSerializer})
    def post(self, request: Request) -> Response:
        data = InvitationAcceptSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = accept_throttled(request, data.validated_data["code"])
        return Response({"team": membership.team.slug, "role": membership.role},
                        status=status.HTTP_201_CREATED)


def accept_throttled(request: HttpRequest | Request, code: str) -> Membership:
    """Accept a code behind the per-address limit on guesses (shared with bearer tokens):
    a wrong code counts as a guess, and past the limit no code is checked (429)."""
    failures = AuthFailureThrottle(client_ip(request))
    failures.check()
    try:
        return services.invitation_accept(actor=Actor.of_user(request.user), code=code)
    except services.InvalidInvitation:
        failures.record_failure()
        raise


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
        services.token_revoke(actor=self.actor, token=cast(ApiToken, self.get_object()))
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
