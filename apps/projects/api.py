from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.projects import services
from apps.projects.models import Project
from apps.teams.viewsets import TeamScopedViewSet


class ProjectSerializer(serializers.ModelSerializer):
    name = serializers.CharField(max_length=limits.NAME, required=False, allow_blank=True)
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True)

    class Meta:
        model = Project
        fields = ["slug", "name", "description", "created_at"]
        read_only_fields = ["created_at"]


class ProjectUpdateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=limits.NAME, required=False)
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True)


class ProjectViewSet(TeamScopedViewSet):
    queryset = Project.objects.all()
    serializer_class = ProjectSerializer
    lookup_field = "slug"
    lookup_url_kwarg = "project"
    ordering_fields = ["slug", "created_at"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(ProjectSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, project: str) -> Response:
        return Response(ProjectSerializer(self.get_object()).data)

    def create(self, request: Request, team: str) -> Response:
        data = ProjectSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = services.project_create(actor=self.actor, team=self.team, **data.validated_data)
        return Response(ProjectSerializer(project).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ProjectUpdateSerializer, responses=ProjectSerializer)
    def partial_update(self, request: Request, team: str, project: str) -> Response:
        data = ProjectUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.project_update(
            actor=self.actor, project=self.get_object(), **data.validated_data
        )
        return Response(ProjectSerializer(obj).data)
