from __future__ import annotations

from rest_framework import serializers

from apps.teams.models import ApiToken, Invitation, Membership, Role, Team


class TeamSerializer(serializers.ModelSerializer):
    role = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = ["slug", "name", "created_at", "role", "metric_retention_days"]
        read_only_fields = ["created_at", "role"]

    def get_role(self, team: Team) -> str | None:
        return getattr(team, "my_role", None)


class TeamCreateSerializer(serializers.Serializer):
    slug = serializers.SlugField(max_length=64)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class TeamUpdateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False)
    # Days of raw metric points to keep (rollups are kept forever); null keeps them all.
    metric_retention_days = serializers.IntegerField(min_value=1, max_value=36500,
                                                     required=False, allow_null=True)


class MembershipSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = Membership
        fields = ["username", "role", "created_at"]
        read_only_fields = fields


class InvitationSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True,
                                              allow_null=True)
    usable = serializers.BooleanField(source="is_usable", read_only=True)

    class Meta:
        model = Invitation
        fields = ["prefix", "team", "role", "max_uses", "uses", "created_by", "created_at",
                  "expires_at", "revoked_at", "usable"]
        read_only_fields = fields


class InvitationCreatedSerializer(InvitationSerializer):
    """The only response that ever contains the code."""

    code = serializers.CharField(read_only=True, help_text="cri_…; give it to the invitee")

    class Meta(InvitationSerializer.Meta):
        fields = [*InvitationSerializer.Meta.fields, "code"]
        read_only_fields = fields


class InvitationCreateSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)
    expires_in_hours = serializers.IntegerField(min_value=1, max_value=24 * 30, default=24 * 7)
    max_uses = serializers.IntegerField(min_value=1, max_value=100, default=1)


class InvitationAcceptSerializer(serializers.Serializer):
    code = serializers.CharField(max_length=200)


class InvitationAcceptedSerializer(serializers.Serializer):
    team = serializers.CharField()
    role = serializers.CharField()


class MembershipUpdateSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices)


class TokenSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True,
                                        help_text="null: a personal token, or an operator's "
                                                  "worker token for every team")
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiToken
        fields = [
            "prefix", "name", "kind", "team", "created_at", "expires_at", "revoked_at",
            "last_used_at", "active",
        ]
        read_only_fields = fields


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class TokenCreatedSerializer(TokenSerializer):
    """The only response that ever contains the secret."""

    token = serializers.CharField(read_only=True)

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]
        read_only_fields = fields
