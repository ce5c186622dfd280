"""The usage API's response shape, for the OpenAPI schema (the selectors build the data)."""

from __future__ import annotations

from rest_framework import serializers

from apps.usage.accounting import IDLE_PARTS, PARTS


def _hours(unit: str) -> type[serializers.Serializer]:
    fields = {"allocated": serializers.FloatField(help_text=f"{unit} held: the sum of the "
                                                             "parts below")}
    for part in (*PARTS, *IDLE_PARTS):
        fields[part] = serializers.FloatField()
    return type(f"Usage{unit.replace('-', '').title()}Serializer", (serializers.Serializer,),
                fields)


class CostSerializer(serializers.Serializer):
    gpu = serializers.FloatField()
    cpu = serializers.FloatField(help_text="core-hours of CPU-only work at the 'cpu' rate")
    total = serializers.FloatField()
    unpriced_gpu_hours = serializers.DictField(
        child=serializers.FloatField(), help_text="GPU-hours per type that has no rate")


class UsageSerializer(serializers.Serializer):
    gpu_hours = _hours("GPU-hours")()
    cpu_hours = _hours("core-hours")()
    gpu_hours_by_type = serializers.DictField(child=serializers.FloatField())
    goodput = serializers.FloatField(allow_null=True,
                                     help_text="useful over allocated GPU-hours (core-hours "
                                               "for CPU-only usage); null when nothing was held")
    cost = CostSerializer()


class RunUsageSerializer(UsageSerializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    kind = serializers.CharField()
    status = serializers.CharField()
    project = serializers.CharField()
    redone_steps = serializers.IntegerField(
        help_text="steps trained twice over the run's life: after each preempted, drained, "
                  "lost or failed attempt, those it reached past the checkpoint the next "
                  "attempt resumed from (as its last metric batch reported)")


class DayUsageSerializer(UsageSerializer):
    day = serializers.DateField(help_text="a UTC day")


# "from" is a Python keyword, so this one is built with type().
TeamUsageSerializer = type("TeamUsageSerializer", (serializers.Serializer,), {
    "from": serializers.DateTimeField(help_text="the window's start"),
    "to": serializers.DateTimeField(help_text="the window's end (exclusive)"),
    "group": serializers.CharField(),
    "currency": serializers.CharField(),
    "rates": serializers.DictField(child=serializers.FloatField(),
                                   help_text="hourly rates per GPU type ('gpu': any other "
                                             "type, 'cpu': per core-hour)"),
    "total": UsageSerializer(),
    "days": DayUsageSerializer(many=True),
    "runs": RunUsageSerializer(many=True, help_text="runs that held something in the window"),
})
