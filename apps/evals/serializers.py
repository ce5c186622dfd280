"""Input and output documents of the eval suite API (thin: services validate entries)."""

from __future__ import annotations

from rest_framework import serializers

from apps.core import limits
from apps.core.serializers import StrictSerializer
from apps.evals.models import EvalSuite, ServedVariant, SuiteEntry, VariantKind


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


class VariantCreateSerializer(StrictSerializer):
    checkpoint = serializers.CharField(max_length=300, help_text="the source: 'checkpoint:<id>' "
                                       "or 'run:<id>[@<step>]'")
    kind = serializers.ChoiceField(choices=VariantKind.choices, help_text=(
        "int8: int8 weights (serve --int8); ngram: speculative decoding by prompt lookup "
        "(--ngram-draft); draft: speculative decoding with a draft checkpoint"))
    label = serializers.CharField(max_length=limits.NAME, required=False, allow_blank=True,
                                  default="")
    int8 = serializers.BooleanField(required=False, default=False,
                                    help_text="speculative kinds: int8 weights for the target "
                                              "too")
    ngram = serializers.IntegerField(required=False, allow_null=True, default=None,
                                     min_value=1, max_value=16,
                                     help_text="kind ngram: n-gram length (default 3)")
    num_speculative_tokens = serializers.IntegerField(required=False, allow_null=True,
                                                      default=None, min_value=1, max_value=16)
    draft_checkpoint = serializers.CharField(required=False, allow_null=True, default=None,
                                             max_length=300, help_text="kind draft: "
                                             "'checkpoint:<id>' or 'run:<id>[@<step>]'")
    suite = serializers.SlugField(required=False, allow_null=True, default=None,
                                  max_length=64, help_text="an eval suite that evaluates the "
                                  "variant now (one eval run per entry)")


class VariantSerializer(serializers.ModelSerializer):
    checkpoint = serializers.IntegerField(source="source_id", read_only=True)
    run = serializers.UUIDField(source="source.run_id", read_only=True)
    step = serializers.IntegerField(source="source.step", read_only=True)
    draft_checkpoint = serializers.IntegerField(source="draft_id", read_only=True,
                                                allow_null=True)
    serve_flags = serializers.SerializerMethodField()

    class Meta:
        model = ServedVariant
        fields = ["id", "kind", "label", "checkpoint", "run", "step", "draft_checkpoint",
                  "serving", "serve_flags", "evaluation", "created_at"]
        read_only_fields = fields

    def get_serve_flags(self, obj: ServedVariant) -> list[str]:
        """The serve command's flags for this variant (after `--model <checkpoint dir>`)."""
        s = obj.serving
        flags = ["--int8"] if s.get("int8") else []
        if s.get("ngram_draft"):
            flags += ["--ngram-draft", str(s["ngram_draft"])]
        if obj.draft_id is not None:
            flags += ["--draft-checkpoint", f"<checkpoint {obj.draft_id} dir>"]
        if obj.kind != "int8":
            flags += ["--num-speculative-tokens", str(s.get("num_speculative_tokens", 4))]
        return flags
