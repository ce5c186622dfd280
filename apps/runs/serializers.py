from __future__ import annotations

from rest_framework import serializers

from apps.runs.models import Checkpoint, Pool, Run, RunEvent, Sample


class PinSerializer(serializers.Serializer):
    alias = serializers.CharField()
    dataset = serializers.CharField(source="dataset_version.dataset.slug")
    digest = serializers.CharField(source="dataset_version.digest")
    number = serializers.IntegerField(source="dataset_version.number")
    record_count = serializers.IntegerField(source="dataset_version.record_count")


class RunSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug", read_only=True)
    datasets = PinSerializer(source="pins", many=True, read_only=True)
    environment = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = [
            "id", "project", "name", "kind", "status", "pool", "priority", "config", "datasets",
            "environment", "attempt", "error", "lease_holder", "lease_expires_at", "created_at",
            "queued_at", "claimed_at", "started_at", "finished_at", "updated_at",
        ]
        read_only_fields = fields

    def get_environment(self, run: Run) -> dict | None:
        ev = run.environment_version
        if ev is None:
            return None
        return {"environment": ev.environment.slug, "digest": ev.digest, "number": ev.number}


class RunCreateSerializer(serializers.Serializer):
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


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["seq", "level", "kind", "message", "data", "created_at"]
        read_only_fields = fields


class CheckpointSerializer(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id", read_only=True)

    class Meta:
        model = Checkpoint
        fields = ["id", "run", "step", "uri", "metrics", "created_at"]
        read_only_fields = fields


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = Sample
        fields = ["id", "step", "prompt", "completion", "reward", "reward_components",
                  "created_at"]
        read_only_fields = fields
