from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import limits
from apps.core.exceptions import NotFound
from apps.core.idempotency import idempotent
from apps.environments import selectors, services
from apps.environments.models import Environment, EnvironmentVersion, QcStatus
from apps.projects.selectors import project_by_slug
from apps.teams.viewsets import TeamScopedViewSet


class EnvironmentVersionSerializer(serializers.ModelSerializer):
    environment = serializers.CharField(source="environment.slug", read_only=True)
    blocked = serializers.SerializerMethodField(
        help_text="QC failed: training runs refuse this version")
    blocked_reason = serializers.SerializerMethodField(
        help_text="why QC blocked it (the report's block reasons)")

    class Meta:
        model = EnvironmentVersion
        fields = ["digest", "number", "environment", "spec", "qc_status", "blocked",
                  "blocked_reason", "qc_report", "created_at"]
        read_only_fields = fields

    def get_blocked(self, obj: EnvironmentVersion) -> bool:
        return obj.qc_status == QcStatus.FAILED

    def get_blocked_reason(self, obj: EnvironmentVersion) -> str:
        return services.blocked_reason(obj)


class EnvironmentSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug", read_only=True)

    class Meta:
        model = Environment
        fields = ["slug", "project", "description", "created_at"]
        read_only_fields = fields


class EnvironmentCreateSerializer(serializers.Serializer):
    slug = serializers.SlugField(max_length=64)
    project = serializers.SlugField(max_length=64)
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True, default="")


class EnvironmentVersionCreateSerializer(serializers.Serializer):
    spec = serializers.DictField()


class EnvironmentViewSet(TeamScopedViewSet):
    queryset = Environment.objects.select_related("project")
    serializer_class = EnvironmentSerializer
    lookup_field = "slug"
    lookup_url_kwarg = "environment"
    filterset_fields = {"project__slug": ["exact"]}
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(EnvironmentSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, environment: str) -> Response:
        return Response(EnvironmentSerializer(self.get_object()).data)

    @extend_schema(request=EnvironmentCreateSerializer, responses={201: EnvironmentSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = EnvironmentCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = project_by_slug(team=self.team, slug=data.validated_data["project"])
        env = services.environment_create(
            actor=self.actor, team=self.team, project=project, slug=data.validated_data["slug"],
            description=data.validated_data["description"],
        )
        return Response(EnvironmentSerializer(env).data, status=status.HTTP_201_CREATED)


class EnvironmentVersionViewSet(TeamScopedViewSet):
    queryset = EnvironmentVersion.objects.select_related("environment")
    serializer_class = EnvironmentVersionSerializer
    lookup_field = "digest"
    lookup_url_kwarg = "version"
    ordering = "-number"

    def base_queryset(self):
        return self.queryset.filter(environment__slug=self.kwargs["environment"])

    def _environment(self) -> Environment:
        env = Environment.objects.filter(team=self.team, slug=self.kwargs["environment"]).first()
        if env is None:
            raise NotFound(f"No environment '{self.kwargs['environment']}' in team "
                           f"'{self.team.slug}'.")
        return env

    def list(self, request: Request, team: str, environment: str) -> Response:
        self._environment()
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(EnvironmentVersionSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, environment: str, version: str) -> Response:
        obj = selectors.version_lookup(self._environment(), version)
        if obj is None:
            raise NotFound(f"No version '{version}' of environment '{environment}'.")
        return Response(EnvironmentVersionSerializer(obj).data)

    @extend_schema(request=EnvironmentVersionCreateSerializer,
                   responses={201: EnvironmentVersionSerializer})
    def create(self, request: Request, team: str, environment: str) -> Response:
        return idempotent(request, lambda: self._create(request))

    def _create(self, request: Request) -> Response:
        env = self._environment()
        data = EnvironmentVersionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version, created = services.version_register(
            actor=self.actor, environment=env, spec=data.validated_data["spec"]
        )
        return Response(EnvironmentVersionSerializer(version).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def _version(self, environment: str, version: str) -> EnvironmentVersion:
        obj = selectors.version_lookup(self._environment(), version)
        if obj is None:
            raise NotFound(f"No version '{version}' of environment '{environment}'.")
        return obj
