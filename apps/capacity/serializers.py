"""The planner's request document (shared by the API and the page's form, so both refuse
the same input in the same words) and the response's shape for the OpenAPI schema."""

from __future__ import annotations

import json
from typing import Any

from rest_framework import serializers

from apps.core.serializers import StrictSerializer
from workers.capacity import GPUS, PRESETS
from workers.capacity.plan import (
    DEFAULT_HEADROOM,
    DEFAULT_MAX_GPUS,
    DEFAULT_PREFILL_CHUNK,
    KV_BYTES,
    WEIGHT_BYTES,
)

CONFIG_MAX_BYTES = 64 * 1024  # a config.json is a few kilobytes
CONFIG_MAX_KEYS = 500
MAX_CONCURRENCY = 1_000_000
MAX_CONTEXT = 10_000_000
MAX_GPUS = 1024
MAX_PREFILL_CHUNK = 1 << 20
SOURCES = ("preset", "config", "checkpoint")


class PlanRequestSerializer(StrictSerializer):
    preset = serializers.ChoiceField(choices=sorted(PRESETS), required=False,
                                     help_text="a named model config")
    config = serializers.DictField(
        required=False, help_text="a Hugging Face config.json object (at most 64 KiB)")
    checkpoint = serializers.CharField(
        max_length=200, required=False,
        help_text="a checkpoint of the team: checkpoint:<id>, run:<run id> (its latest) or "
                  "run:<run id>@<step>; its saved config.json is read")
    gpu = serializers.ChoiceField(choices=list(GPUS), default="H100-80GB")
    concurrency = serializers.IntegerField(
        min_value=1, max_value=MAX_CONCURRENCY, help_text="sequences decoded together")
    context = serializers.IntegerField(
        min_value=1, max_value=MAX_CONTEXT,
        help_text="tokens each sequence holds in the KV cache (prompt plus output)")
    dtype = serializers.ChoiceField(choices=list(WEIGHT_BYTES), default="bf16",
                                    help_text="weight dtype of the linear layers")
    kv_dtype = serializers.ChoiceField(choices=list(KV_BYTES), default="bf16")
    headroom = serializers.FloatField(
        min_value=0.0, max_value=0.9, default=DEFAULT_HEADROOM,
        help_text="fraction of each GPU's memory kept free")
    prefill_chunk = serializers.IntegerField(
        min_value=1, max_value=MAX_PREFILL_CHUNK, default=DEFAULT_PREFILL_CHUNK,
        help_text="tokens per chunked-prefill step")
    max_gpus = serializers.IntegerField(min_value=1, max_value=MAX_GPUS,
                                        default=DEFAULT_MAX_GPUS)

    def validate_config(self, value: dict[str, Any]) -> dict[str, Any]:
        if len(value) > CONFIG_MAX_KEYS:
            raise serializers.ValidationError(
                f"config has {len(value)} keys; a model's config.json has far fewer than "
                f"{CONFIG_MAX_KEYS}.")
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError, RecursionError) as exc:
            raise serializers.ValidationError("config must be plain JSON.") from exc
        if size > CONFIG_MAX_BYTES:
            raise serializers.ValidationError(
                f"config is {size} bytes; at most {CONFIG_MAX_BYTES} (paste the model's "
                "config.json, not its weights index or tokenizer).")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        given = [s for s in SOURCES if attrs.get(s) not in (None, "", {})]
        if len(given) != 1:
            raise serializers.ValidationError(
                {"model": [f"give exactly one of preset, config or checkpoint (got "
                           f"{', '.join(given) or 'none'})."]})
        return attrs


# --- the response, for the schema ----------------------------------------------------------


class _MoeSerializer(serializers.Serializer):
    num_experts = serializers.IntegerField()
    experts_per_token = serializers.IntegerField()
    expert_intermediate_size = serializers.IntegerField()
    shared_expert_intermediate_size = serializers.IntegerField()
    moe_layers = serializers.IntegerField()
    params_per_expert = serializers.IntegerField()


class _ModelSerializer(serializers.Serializer):
    model_type = serializers.CharField()
    hidden_size = serializers.IntegerField()
    num_layers = serializers.IntegerField()
    num_attention_heads = serializers.IntegerField()
    num_key_value_heads = serializers.IntegerField()
    head_dim = serializers.IntegerField()
    vocab_size = serializers.IntegerField()
    attention = serializers.ChoiceField(choices=["gqa", "mla"])
    sliding_window_layers = serializers.IntegerField()
    moe = _MoeSerializer(allow_null=True)
    params_total = serializers.IntegerField()
    params_active = serializers.IntegerField()
    params_by_kind = serializers.DictField(child=serializers.IntegerField())


class _MemorySerializer(serializers.Serializer):
    weights_by_dtype = serializers.DictField(child=serializers.IntegerField(),
                                             help_text="bytes per weight dtype")
    weights = serializers.IntegerField(help_text="bytes at the requested dtype")
    kv_per_token = serializers.IntegerField()
    kv_per_sequence = serializers.IntegerField()
    kv_total = serializers.IntegerField()
    prefill_activations = serializers.IntegerField()
    logits = serializers.IntegerField()


class _DecodeSerializer(serializers.Serializer):
    weight_bytes_per_token = serializers.IntegerField()
    kv_bytes_per_token = serializers.IntegerField()
    bytes_per_token = serializers.IntegerField()


class LayoutSerializer(serializers.Serializer):
    tp = serializers.IntegerField()
    dp = serializers.IntegerField(help_text="data-parallel groups of tp GPUs")
    ep = serializers.IntegerField(help_text="expert-parallel size (1: experts split by TP)")
    gpus = serializers.IntegerField()
    valid = serializers.BooleanField()
    reason = serializers.CharField(allow_blank=True)
    fits = serializers.BooleanField()
    notes = serializers.ListField(child=serializers.CharField())
    weights_per_gpu = serializers.IntegerField(required=False)
    kv_per_gpu = serializers.IntegerField(required=False)
    activations_per_gpu = serializers.IntegerField(required=False)
    total_per_gpu = serializers.IntegerField(required=False)
    usable_per_gpu = serializers.IntegerField(required=False)
    decode_bytes_per_step = serializers.IntegerField(required=False)
    decode_tokens_s = serializers.FloatField(required=False)
    decode_tokens_s_per_sequence = serializers.FloatField(required=False)


class PlanSerializer(serializers.Serializer):
    source = serializers.CharField()
    model = _ModelSerializer()
    request = serializers.DictField()
    gpu = serializers.DictField()
    memory = _MemorySerializer()
    decode = _DecodeSerializer()
    layouts = LayoutSerializer(many=True)
    recommended = LayoutSerializer(allow_null=True)
    gpus_needed = serializers.IntegerField(allow_null=True)
    warnings = serializers.ListField(child=serializers.CharField())


class GpuSerializer(serializers.Serializer):
    key = serializers.CharField()
    name = serializers.CharField()
    memory_bytes = serializers.IntegerField()
    bandwidth_bytes_s = serializers.IntegerField()


class CatalogSerializer(serializers.Serializer):
    gpus = GpuSerializer(many=True)
    presets = serializers.DictField(child=serializers.DictField())
    dtypes = serializers.ListField(child=serializers.CharField())
    kv_dtypes = serializers.ListField(child=serializers.CharField())
