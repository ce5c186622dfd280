"""Config models for the RL engine's data pipeline and its vLLM rollout backend.

Pure (pydantic and the standard library only), like `spec.py`, so the control plane can validate
a run's config without torch or vllm. Meant to join `RunSpec` as `data: DataCacheSpec` and
`vllm: VllmSpec`; every model forbids unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataCacheSpec(_Strict):
    """Task records from the object store through memory LRU -> local disk -> object store.

    `source` is an object-store URI (`file:///...` or `s3://bucket/...`) of a shard manifest
    written by `workers.rl.datacache.write_shards`, or of one JSONL object (e.g. a dataset
    version); None keeps the objective's own training examples.
    """

    source: str | None = None
    prompt_field: str = "prompt"
    reference_field: str = "reference"
    memory_mb: PosFloat = 256.0
    disk_dir: str | None = "var/rl/datacache"  # None: no disk tier
    disk_mb: PosFloat = 4096.0
    prefetch_shards: NonNegInt = 2  # shards fetched ahead of the consumer
    workers: PosInt = 2  # background fetch threads
    retries: NonNegInt = 2  # extra attempts on a transient store error
    wait_timeout_s: PosFloat = 300.0  # a fetch the consumer waits on longer than this fails
    seed: int = 0  # shard and record order per epoch

    @model_validator(mode="after")
    def _check(self) -> DataCacheSpec:
        if self.source is not None and not self.source.startswith(("file://", "s3://")):
            raise ValueError("data.source must be a file:// or s3:// object-store URI")
        return self


class RopeScalingSpec(_Strict):
    """Long context by RoPE scaling: the checkpoint's `rope_parameters` with these replaced,
    as vLLM's `hf_overrides` and Qwen's model cards give them (e.g. yarn, factor 4 over 32k)."""

    rope_type: Literal["linear", "dynamic", "yarn", "longrope", "llama3"] = "yarn"
    factor: Annotated[float, Field(ge=1.0)] = 4.0
    original_max_position_embeddings: PosInt | None = None  # default: the checkpoint's

    def overrides(self, config: dict) -> dict:
        """`hf_overrides` for a checkpoint whose config.json is `config`: its RoPE parameters
        (rope_theta kept) with these set, and the stretched context."""
        base = dict(config.get("rope_parameters") or {})
        if "rope_theta" in config:
            base.setdefault("rope_theta", config["rope_theta"])
        original = self.original_max_position_embeddings or config.get(
            "max_position_embeddings")
        params = {**base, "rope_type": self.rope_type, "factor": self.factor}
        if original:
            params["original_max_position_embeddings"] = original
        return {"rope_parameters": params}


class VllmSpec(_Strict):
    """The vLLM rollout engine (`rollout.backend = "vllm"`, GPU pools; `pip install .[gpu]`).

    Defaults suit a policy colocated with its trainer on the same GPUs: vLLM takes a share of
    memory and runs in-process, so weights move to it without serialisation.
    """

    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    tensor_parallel_size: PosInt = 1
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: PosInt | None = None
    enable_prefix_caching: bool = True  # group members share their prompt's KV blocks
    enable_chunked_prefill: bool = True  # long prompts prefill in chunks beside decodes
    max_num_batched_tokens: PosInt | None = None  # chunk budget per engine step
    max_num_seqs: PosInt | None = None
    # Long context: RoPE scaling (set max_model_len to the stretched length, e.g. 4 x 32k).
    rope_scaling: RopeScalingSpec | None = None
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower decode)
    sleep_between_steps: bool = False  # free vLLM's KV cache while the trainer runs
    sync_timeout_s: PosFloat = 300.0  # a weight push slower than this fails loudly
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> VllmSpec:
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and not self.enable_chunked_prefill
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             "max_model_len (a whole prompt is prefilled in one step)")
        return self
