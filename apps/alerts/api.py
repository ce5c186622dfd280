"""``/api/v1/teams/<team>/alert-rules``, ``…/alerts`` and ``…/webhook-deliveries``: rule
CRUD (members write, viewers read), the alerts the rules fired, and each webhook delivery
with its log of attempts. The signing secret is shown once, when it is made."""

from __future__ import annotations

from typing import Any, cast

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.alerts import rules, services
from apps.alerts.models import Alert, AlertRule, Delivery, DeliveryAttempt, RuleKind
from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.core.serializers import StrictSerializer
from apps.projects.models import Project
from apps.teams.api import secret_response
from apps.teams.viewsets import TeamScopedViewSet

MAX_COOLDOWN_S = 30 * 86400


class AlertRuleSerializer(serializers.ModelSerializer):
    # null: the rule watches every project of the team (the API fuzz caught it undocumented).
    project = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    has_webhook_secret = serializers.SerializerMethodField()

    class Meta:
        model = AlertRule
        fields = ["id", "name", "kind", "params", "project", "enabled", "cooldown_s",
                  "webhook_url", "has_webhook_secret", "created_at", "updated_at"]
        read_only_fields = fields

    def get_has_webhook_secret(self, rule: AlertRule) -> bool:
        return bool(rule.webhook_secret)


class AlertRuleCreatedSerializer(AlertRuleSerializer):
    webhook_secret = serializers.CharField(
        read_only=True, help_text="Standard Webhooks signing secret (whsec_…); shown once")

    class Meta(AlertRuleSerializer.Meta):
        fields = [*AlertRuleSerializer.Meta.fields, "webhook_secret"]
        read_only_fields = fields


class AlertRuleInputSerializer(StrictSerializer):
    name = serializers.CharField(max_length=limits.NAME)
    kind = serializers.ChoiceField(choices=RuleKind.choices)
    params = serializers.JSONField(required=False, default=dict,
                                   help_text="the kind's parameters (docs/alerts.md)")
    project = serializers.CharField(max_length=64, required=False, allow_blank=True,
                                    default="", help_text="slug; blank: every project")
    enabled = serializers.BooleanField(required=False, default=True)
    cooldown_s = serializers.IntegerField(min_value=0, max_value=MAX_COOLDOWN_S,
                                          required=False, default=3600)
    webhook_url = serializers.CharField(max_length=2000, required=False, allow_blank=True,
                                        default="")


class AlertRuleUpdateSerializer(AlertRuleInputSerializer):
    """The same fields, each optional (used with ``partial=True``: no defaults applied)."""


class AlertSerializer(serializers.ModelSerializer):
    rule = serializers.PrimaryKeyRelatedField(read_only=True)
    rule_name = serializers.CharField(source="rule.name", read_only=True)

    class Meta:
        model = Alert
        fields = ["id", "rule", "rule_name", "kind", "key", "run", "message", "value", "data",
                  "created_at"]
        read_only_fields = fields


class DeliveryAttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeliveryAttempt
        fields = ["number", "status_code", "error", "response", "duration_ms", "created_at"]
        read_only_fields = fields


class DeliverySerializer(serializers.ModelSerializer):
    log = serializers.SerializerMethodField(help_text="attempts, oldest first")

    class Meta:
        model = Delivery
        fields = ["id", "alert", "url", "msg_id", "status", "attempts", "last_status_code",
                  "next_attempt_at", "created_at", "finished_at", "log"]
        read_only_fields = fields

    @extend_schema_field(DeliveryAttemptSerializer(many=True))
    def get_log(self, delivery: Delivery) -> list[dict[str, Any]]:
        attempts = sorted(delivery.log.all(), key=lambda a: a.number)
        return list(DeliveryAttemptSerializer(attempts, many=True).data)


def _project(team_id: int, slug: str) -> Project | None:
    if not slug:
        return None
    project = Project.objects.filter(team_id=team_id, slug=slug).first()
    if project is None:
        raise InvalidInput(f"No project '{slug[:64]}' in this team.",
                           details={"project": [slug[:64]]})
    return project


class AlertRuleViewSet(TeamScopedViewSet):
    queryset = AlertRule.objects.select_related("project")
    serializer_class = AlertRuleSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "rule"
    lookup_value_regex = r"[0-9]+"
    filterset_fields = {"kind": ["exact"], "enabled": ["exact"]}
    ordering_fields = ["created_at", "name"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(AlertRuleSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, rule: str) -> Response:
        return Response(AlertRuleSerializer(self.get_object()).data)

    @extend_schema(request=AlertRuleInputSerializer, responses={201: AlertRuleCreatedSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = AlertRuleInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        fields["project"] = _project(self.team.pk, fields.pop("project"))
        rule = services.rule_create(actor=self.actor, team=self.team, **fields)
        return secret_response(AlertRuleCreatedSerializer(rule).data)

    @extend_schema(request=AlertRuleUpdateSerializer, responses=AlertRuleSerializer)
    def partial_update(self, request: Request, team: str, rule: str) -> Response:
        data = AlertRuleUpdateSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        if "project" in fields:
            fields["project"] = _project(self.team.pk, fields["project"])
        obj = services.rule_update(actor=self.actor, rule=cast(AlertRule, self.get_object()),
                                   **fields)
        return Response(AlertRuleSerializer(obj).data)

    def destroy(self, request: Request, team: str, rule: str) -> Response:
        services.rule_delete(actor=self.actor, rule=cast(AlertRule, self.get_object()))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={201: AlertRuleCreatedSerializer})
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, team: str, rule: str) -> Response:
        """A new signing secret (shown once); the old one stops signing at once."""
        obj = services.rule_rotate_secret(actor=self.actor,
                                          rule=cast(AlertRule, self.get_object()))
        return secret_response(AlertRuleCreatedSerializer(obj).data)

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    @action(detail=False, methods=["get"])
    def kinds(self, request: Request, team: str) -> Response:
        """Each rule kind with its parameters' JSON schema (defaults included)."""
        return Response({kind: model.model_json_schema()
                         for kind, model in rules.PARAMS.items()})


class AlertViewSet(TeamScopedViewSet):
    queryset = Alert.objects.select_related("rule")
    serializer_class = AlertSerializer
    lookup_field = "pk"
    lookup_url_kwarg = "alert"
    lookup_value_regex = r"[0-9]+"
    filterset_fields = {"run": ["exact"], "rule": ["exact"], "kind": ["exact"]}
    ordering_fields = ["created_at"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(AlertSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, alert: str) -> Response:
        return Response(AlertSerializer(self.get_object()).data)


class DeliveryViewSet(TeamScopedViewSet):
    queryset = Delivery.objects.prefetch_related("log")
    serializer_class = DeliverySerializer
    lookup_field = "pk"
    lookup_url_kwarg = "delivery"
    lookup_value_regex = r"[0-9]+"
    filterset_fields = {"alert": ["exact"], "status": ["exact"]}
    ordering_fields = ["created_at"]
    ordering = "-created_at"

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(DeliverySerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, delivery: str) -> Response:
        return Response(DeliverySerializer(self.get_object()).data)

