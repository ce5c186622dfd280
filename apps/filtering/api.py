"""The team's output-filter policy (viewers read, admins set) and its findings log."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.serializers import StrictSerializer
from apps.filtering import selectors, services
from apps.filtering.models import FilterPolicy, Finding
from apps.teams.models import Role
from apps.teams.viewsets import TeamScopedViewSet
from workers.filtering import KINDS, Mode

MODES = [m.value for m in Mode]


class PolicySerializer(serializers.ModelSerializer):
    updated_by = serializers.SlugRelatedField(slug_field="username", read_only=True,
                                              allow_null=True)
    modes = serializers.SerializerMethodField()
    kinds = serializers.SerializerMethodField()

    class Meta:
        model = FilterPolicy
        fields = ["samples", "serve", "export", "updated_by", "updated_at", "modes", "kinds"]
        read_only_fields = fields

    def get_modes(self, obj: FilterPolicy) -> list[str]:
        return MODES

    def get_kinds(self, obj: FilterPolicy) -> list[str]:
        return list(KINDS)


class PolicyUpdateSerializer(StrictSerializer):
    samples = serializers.ChoiceField(choices=MODES, required=False)
    serve = serializers.ChoiceField(choices=MODES, required=False)
    export = serializers.ChoiceField(choices=MODES, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise serializers.ValidationError(
                {"non_field_errors": ["Name at least one surface: samples, serve, export."]})
        return attrs


class FindingSerializer(serializers.ModelSerializer):
    class Meta:
        model = Finding
        fields = ["id", "surface", "action", "target_type", "target_id", "kinds", "count",
                  "created_at"]
        read_only_fields = fields


class FilterPolicyViewSet(TeamScopedViewSet):
    """``GET`` the mode of each surface (``off`` for a team that never set one) and the
    kinds the detector knows; ``PATCH`` some surfaces' modes (admins; audited)."""

    method_roles = {"PATCH": Role.ADMIN}
    queryset = FilterPolicy.objects.select_related("updated_by")
    serializer_class = PolicySerializer

    def retrieve(self, request: Request, team: str) -> Response:
        return Response(PolicySerializer(selectors.policy(self.team.pk)).data)

    @extend_schema(request=PolicyUpdateSerializer, responses=PolicySerializer)
    def partial_update(self, request: Request, team: str) -> Response:
        data = PolicyUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        row = services.set_policy(actor=self.actor, team=self.team, **data.validated_data)
        return Response(PolicySerializer(row).data)


class FindingViewSet(TeamScopedViewSet):
    """What the filter found (kinds, never the text), newest first; filter by
    ``surface``, ``action``, ``target_type``, ``target_id``."""

    queryset = Finding.objects.all()
    serializer_class = FindingSerializer
    filterset_fields = {"surface": ["exact"], "action": ["exact"], "target_type": ["exact"],
                        "target_id": ["exact"]}
    ordering_fields = ["created_at"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(FindingSerializer(page, many=True).data)


