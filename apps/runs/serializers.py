from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.serializers import StrictSerializer
from apps.runs import selectors
from apps.runs.models import Checkpoint, Pool, Run, RunAttempt, RunEvent, Sample


class PinSerializer(serializers.Serializer):
    alias = serializers.CharField()
    dataset = serializers.CharField(source="dataset_version.dataset.slug")
    digest = serializers.CharField(source="dataset_version.digest")
    number = serializers.IntegerField(source="dataset_version.number")
    record_count = serializers.IntegerField(source="dataset_version.record_count")


class AttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunAttempt
        fields = ["number", "worker", "outcome", "error", "claimed_at", "started_at",
                  "resume_step", "ended_at"]
        read_only_fields = fields


class RunSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug", read_only=True)
    datasets = PinSerializer(source="pins", many=True, read_only=True)
    environment = serializers.SerializerMethodField()
    environments = serializers.SerializerMethodField()
    base_model = serializers.SerializerMethodField()
    attempts = AttemptSerializer(many=True, read_only=True)
    tags = serializers.ListField(child=serializers.CharField(), read_only=True)
    allocation = serializers.SerializerMethodField(
        help_text="node name -> GPU ids the scheduler gave the run (empty when it holds none)")

    class Meta:
        model = Run
        fields = [
            "id", "project", "name", "kind", "status", "pool", "priority", "config", "datasets",
            "environment", "environments", "base_model", "tags", "attempt", "max_attempts",
            "attempts",
            "error", "lease_holder", "lease_expires_at", "created_at", "queued_at",
            "claimed_at", "started_at", "finished_at", "updated_at",
            "resources", "priority_class", "wait_reason", "queue_position",
            "estimated_start_at", "preemptions", "allocation",
        ]
        read_only_fields = fields

    def get_allocation(self, run: Run) -> dict[str, list[int]]:
        return {a.node.name: list(a.gpu_ids) for a in selectors.active_allocations(run)}

    def get_environment(self, run: Run) -> dict | None:
        ev = run.environment_version
        if ev is None:
            return None
        return {"environment": ev.environment.slug, "digest": ev.digest, "number": ev.number}

    def get_environments(self, run: Run) -> list[dict]:
        return [
            {"environment": pin.environment_version.environment.slug,
             "digest": pin.environment_version.digest, "number": pin.environment_version.number}
            for pin in run.environment_pins.all()
        ]

    def get_base_model(self, run: Run) -> dict | None:
        ckpt = run.base_checkpoint
        if ckpt is None:
            return None
        return {"checkpoint": ckpt.pk, "run": str(ckpt.run_id), "step": ckpt.step,
                "uri": ckpt.uri}


class AttemptTimeSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    outcome = serializers.CharField()
    startup_s = serializers.FloatField(help_text="claim → work began")
    useful_s = serializers.FloatField(help_text="work that survives in the run's history")
    lost_s = serializers.FloatField(help_text="work after its last kept checkpoint, redone")


class GoodputSerializer(serializers.Serializer):
    """Seconds since the run's first claim (to its finish, or now), split by where they went;
    they add up to ``wall_s`` (apps.runs.goodput)."""

    goodput = serializers.FloatField(allow_null=True,
                                     help_text="useful_s / wall_s; null before the first claim")
    wall_s = serializers.FloatField()
    useful_s = serializers.FloatField()
    queued_s = serializers.FloatField(help_text="between attempts, waiting to be claimed")
    startup_s = serializers.FloatField()
    lost_preemption_s = serializers.FloatField(
        help_text="work redone after scheduler preemptions and worker drains")
    lost_failure_s = serializers.FloatField(
        help_text="work redone after lost workers and failed attempts")
    attempts = AttemptTimeSerializer(many=True)


class RunDetailSerializer(RunSerializer):
    """One run, with its goodput (computed per request, so not in lists)."""

    goodput = serializers.SerializerMethodField()

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "goodput"]
        read_only_fields = fields

    @extend_schema_field(GoodputSerializer)
    def get_goodput(self, run: Run) -> dict[str, object]:
        return selectors.run_goodput(run).as_dict()


class RunCreateSerializer(StrictSerializer):
    project = serializers.SlugField()
    kind = serializers.CharField(max_length=16)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    config = serializers.JSONField(default=dict)
    pool = serializers.ChoiceField(choices=Pool.choices, required=False, allow_null=True,
                                   default=None)
    priority = serializers.IntegerField(min_value=-100, max_value=100, default=0)
    datasets = serializers.ListField(child=serializers.CharField(max_length=200), default=list,
                                     max_length=64)
    environment = serializers.CharField(max_length=200, required=False, allow_null=True,
                                        default=None)
    environments = serializers.ListField(child=serializers.CharField(max_length=200),
                                         default=list, max_length=64)
    base_model = serializers.CharField(max_length=1000, required=False, allow_null=True,
                                       default=None)
    max_attempts = serializers.IntegerField(required=False, allow_null=True, default=None)
    # Length and characters are checked by plan_run (one message naming ``tags``, the same
    # for the API and the launch form); here only "a list of strings".
    tags = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False), default=list,
        help_text="Up to 16 labels, each 1-40 letters, digits, '-', '_' or '.'; frozen at "
                  "launch and filterable with ?tag=.")
    # Checked by plan_run against workers.scheduling.spec.Resources (one message naming the
    # field); default: one GPU on one node for pool gpu, one CPU core otherwise.
    resources = serializers.JSONField(required=False, allow_null=True, default=None)
    priority_class = serializers.CharField(max_length=64, required=False, allow_null=True,
                                           allow_blank=True, default=None)


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["seq", "level", "kind", "message", "data", "created_at"]
        read_only_fields = fields


class CheckpointSerializer(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id", read_only=True)

    class Meta:
        model = Checkpoint
        fields = ["id", "run", "step", "uri", "metrics", "resumable", "pruned_at", "created_at"]
        read_only_fields = fields


class SampleSerializer(serializers.ModelSerializer):
    # What the output filter found when the sample was stored (``{"action": "flag" |
    # "redact", "kinds": [...]}``), else null; set on each object by the view.
    filter = serializers.SerializerMethodField()

    class Meta:
        model = Sample
        fields = ["id", "step", "prompt", "completion", "reward", "reward_components",
                  "advantage", "weight_version", "finish_reason", "created_at", "filter"]
        read_only_fields = fields

    def get_filter(self, obj: Sample) -> dict[str, Any] | None:
        return getattr(obj, "filter_flag", None)
