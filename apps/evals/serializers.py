"""Input and output documents of the eval suite API (thin: services validate entries)."""

from __future__ import annotations

from rest_framework import serializers

from apps.core import limits
from apps.core.serializers import StrictSerializer
from apps.evals.models import EvalSuite, SuiteEntry


class SuiteCreateSerializer(StrictSerializer):
    slug = serializers.SlugField(max_length=64)
    project = serializers.SlugField(max_length=64)
    name = serializers.CharField(max_length=limits.NAME, required=False, allow_blank=True,
                                 default="")
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True, default="")
    entries = serializers.ListField(child=serializers.JSONField(), min_length=1,
                                    max_length=32, help_text=(
                                        "each {environment: '<slug>@v<n>', split?, "
                                        "samples_per_task?, k?, sampling?, limit?, "
                                        "concurrency?, metric?: 'pass@<k>'|'mean_reward', "
                                        "threshold?: 0..1}"))


class SuiteUpdateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=limits.NAME, required=False)
    description = serializers.CharField(max_length=limits.DESCRIPTION, required=False,
                                        allow_blank=True)
    baseline = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                        help_text="a finished evaluation of this suite, or "
                                                  "null")


class EntrySerializer(serializers.ModelSerializer):
    environment = serializers.SerializerMethodField()
    digest = serializers.CharField(source="environment_version.digest", read_only=True)

    class Meta:
        model = SuiteEntry
        fields = ["position", "environment", "digest", "params", "metric", "threshold"]
        read_only_fields = fields

    def get_environment(self, obj: SuiteEntry) -> str:
        version = obj.environment_version
        return f"{version.environment.slug}@v{version.number}"


class SuiteSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug", read_only=True)
    entries = EntrySerializer(many=True, read_only=True)

    class Meta:
        model = EvalSuite
        fields = ["slug", "name", "description", "project", "baseline", "entries",
                  "created_at"]
        read_only_fields = fields


class EvaluateSerializer(StrictSerializer):
    base_model = serializers.CharField(required=False, allow_null=True, default=None,
                                       max_length=300, help_text="'checkpoint:<id>', "
                                       "'run:<id>[@<step>]', 'preset' or 'path:/dir'")
    policy = serializers.DictField(required=False, allow_null=True, default=None,
                                   help_text="an OpenAI-compatible endpoint (a served "
                                             "variant): {base_url, model, api?}")
    label = serializers.CharField(max_length=limits.NAME, required=False, allow_blank=True,
                                  default="")


class PromoteSerializer(StrictSerializer):
    note = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
