"""The typed document that fully describes one RL run.

Only pydantic and the standard library are imported here so the control plane can validate a
run's config at creation time without torch. Every model forbids unknown fields, so a typo is an
error that names the field instead of a silently ignored setting.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from workers.envs.spec import ArithmeticSpec, EndpointPolicySpec, EnvironmentSpec, EvalParams

# Re-exported for the control plane's launch check (it may import specs, not engines).
from workers.rl.pinned_data import (  # noqa: F401
    PinnedDataError,
    check_roles,
    record_role,
    shape_hint,
    template_fields,
)
from workers.rl.spec_data import DataCacheSpec, VllmSpec

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyMoeSpec(_Strict):
    """Shape of the built-in random-init Qwen3-MoE preset used for CPU runs and tests."""

    hidden_size: PosInt = 64
    num_layers: PosInt = 4
    num_heads: PosInt = 4
    num_kv_heads: PosInt = 2
    head_dim: PosInt = 16
    num_experts: PosInt = 8
    experts_per_token: PosInt = 2
    moe_intermediate_size: PosInt = 64
    max_position_embeddings: PosInt = 128

    @model_validator(mode="after")
    def _check(self) -> TinyMoeSpec:
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must be <= num_experts")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


# Stacked expert weights (Qwen3-MoE's `experts.gate_up_proj` / `experts.down_proj`) are 3-d
# parameters of one module, not nn.Linear layers, so peft cannot put an adapter on them.
LORA_EXPERT_NAMES = ("experts", "gate_up_proj")


class LoraSpec(_Strict):
    """`model.lora`: train low-rank adapters (peft) instead of every weight. `target_modules`
    are nn.Linear module names; the default is the attention projections, which every
    Qwen3(-MoE) layer has. Expert MLPs cannot be targeted (stacked parameters, not Linear)."""

    r: PosInt = 8
    alpha: PosInt = 16
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("model.lora.target_modules must name at least one module")
        experts = [t for t in v if any(e in t for e in LORA_EXPERT_NAMES)]
        if experts:
            raise ValueError(f"model.lora.target_modules {experts}: MoE expert weights are "
                             "stacked 3-d parameters, not nn.Linear layers, and cannot carry "
                             "LoRA adapters; target attention (q_proj, k_proj, v_proj, o_proj) "
                             "or other Linear layers")
        return v


class ModelSpec(_Strict):
    """Either a local Hugging Face model directory or the tiny MoE preset, optionally trained
    through LoRA adapters (`lora`)."""

    source: Literal["preset", "path"] = "preset"
    path: str | None = None
    preset: TinyMoeSpec = TinyMoeSpec()
    router_aux_loss_coef: NonNegFloat = 0.01
    seed: int = 0
    lora: LoraSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.source == "path" and not self.path:
            raise ValueError("model.path is required when model.source = 'path'")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "lora")


DEFAULT_VOCAB_SIZE = 96
DEFAULT_CHECKPOINT_DIR = "var/rl/checkpoints"


def _drop_none(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A frozen config names only what applies: optional fields left unset are left out."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class TokenizerSpec(_Strict):
    """`model`: load from the model directory; `train`: BPE trained on the objective's corpus,
    with `vocab_size` tokens (default 96). A model's own tokenizer has its own vocabulary, so
    `vocab_size` is refused with `source = 'model'` instead of being carried along unused."""

    source: Literal["model", "train"] = "train"
    vocab_size: PosInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("source", "train") == "train" \
                and data.get("vocab_size") is None:
            return {**data, "vocab_size": DEFAULT_VOCAB_SIZE}
        return data

    @model_validator(mode="after")
    def _check(self) -> TokenizerSpec:
        if self.source == "model" and self.vocab_size is not None:
            raise ValueError("tokenizer.vocab_size applies to a trained tokenizer (source = "
                             "'train'); with source = 'model' the model's own tokenizer and "
                             "vocabulary are used: remove vocab_size")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "vocab_size")


class RolloutSpec(_Strict):
    # "hf": transformers generate (CPU or GPU); "vllm": GPU pools, configured by `vllm`.
    backend: Literal["hf", "vllm"] = "hf"
    # How the hf backend schedules its rows. "batch": one padded batch decoded until every row
    # has finished. "continuous": the inference server's scheduler (workers/rl/continuous.py):
    # finished rows leave the batch, and a multi-turn episode's next turn reuses the keys of
    # the context it continues. Both sample the same distribution and return the same layout
    # (tokens, logprobs, routes); they draw from the generator differently, so one seed gives
    # other samples on each.
    engine: Literal["batch", "continuous"] = "batch"
    group_size: Annotated[int, Field(ge=2)] = 8
    max_new_tokens: PosInt = 6
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: list[str] = []


class SftSpec(_Strict):
    """Cross-entropy warm start before RL (0 steps disables it), on the environment's reference
    completions and on the run's pinned SFT datasets (see pinned_data.py)."""

    steps: NonNegInt = 0
    lr: Annotated[float, Field(gt=0.0)] = 3e-3
    batch_size: PosInt = 32
    environment: bool = True  # also imitate the objective's own reference completions
    prompt_template: str | None = None  # pinned record -> prompt, e.g. "{problem[expression]}="
    completion_template: str | None = None  # pinned record -> completion, e.g. "{answer}"

    @model_validator(mode="after")
    def _check(self) -> SftSpec:
        for name in ("prompt_template", "completion_template"):
            template = getattr(self, name)
            if template is not None:
                try:
                    template_fields(template)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from exc
        if (self.prompt_template is None) != (self.completion_template is None):
            raise ValueError("set both sft.prompt_template and sft.completion_template, or "
                             "neither")
        return self


class PreferenceSpec(_Strict):
    """Offline DPO on the run's pinned preference datasets, after SFT and before RL, against
    the frozen warm-started policy (0 steps disables it)."""

    steps: NonNegInt = 0
    lr: Annotated[float, Field(gt=0.0)] = 1e-3
    batch_size: PosInt = 16
    beta: Annotated[float, Field(gt=0.0)] = 0.1


class CurriculumSpec(_Strict):
    """Online difficulty filtering and a pass-rate band over tasks (see curriculum.py)."""

    filter_uniform: bool = False  # skip groups whose rewards are all equal, sample more
    max_rounds: PosInt = 4  # generation rounds per step to replace skipped groups
    band_low: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    band_high: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    min_seen: PosInt = 1  # groups seen before a task's pass rate is trusted
    explore: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1  # chance to take an out-of-band task
    ema: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5  # weight of the newest group's pass rate
    pass_threshold: float = 0.5  # a completion with reward >= this counts as a pass
    # Replay of valid but failed trajectories (reward < pass_threshold, not infrastructure):
    # each slot of a draw takes the oldest buffered failed task with this probability.
    replay_share: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    replay_capacity: Annotated[int, Field(ge=1, le=100_000)] = 256  # tasks kept, oldest out

    @model_validator(mode="after")
    def _check(self) -> CurriculumSpec:
        if self.band_low > self.band_high:
            raise ValueError("band_low must be <= band_high")
        return self


class TriageSpec(_Strict):
    """Rollouts the platform failed (a sandbox error, a lost or reclaimed session, a tool's
    infrastructure timing out; see workers/rl/triage.py): each failed grading is re-run, each
    void episode re-played, up to `retries` times; a sample still failing drops its group
    (replaced by more prompts within curriculum.max_rounds). Never trained on with reward 0."""

    retries: Annotated[int, Field(ge=0, le=10)] = 2


# Settings that belong to one `algorithm.importance` mode: given with another mode, an error.
MODE_SETTINGS: dict[str, tuple[str, ...]] = {
    "seq_log_ratio": ("seq_tis", "seq_mis"),
    "seq_mask_low": ("seq_mis",),
    "seq_mask_high": ("seq_mis",),
    "gspo_clip_low": ("gspo",),
    "gspo_clip_high": ("gspo",),
}
_MODE_DEFAULTS: dict[str, Any] = {"seq_log_ratio": "sum", "seq_mask_low": 0.5,
                                  "seq_mask_high": 2.0, "gspo_clip_low": 3e-4,
                                  "gspo_clip_high": 4e-4}


class AlgorithmSpec(_Strict):
    """The RL objective. `importance` picks how the ratio pi_theta / pi_rollout enters the
    policy-gradient loss (see workers/rl/importance.py and docs/rl.md): clip (PPO), tis (token
    truncated IS), cispo, seq_tis / seq_mis (sequence-level truncated / masked IS), gspo. The
    settings of one mode only (seq_*, gspo_*) are refused with another, and left out of the
    frozen config when unset (`mode_setting` gives their defaults)."""

    advantage: Literal["grpo", "grpo_no_std", "dr_grpo", "rloo"] = "grpo"
    loss_agg: Literal["token_mean", "seq_mean", "seq_sum_norm"] = "token_mean"
    importance: Literal["clip", "tis", "cispo", "seq_tis", "seq_mis", "gspo"] = "clip"
    clip_low: NonNegFloat = 0.2  # clip and cispo
    clip_high: NonNegFloat = 0.28  # clip and cispo (clip-higher: > clip_low)
    tis_cap: Annotated[float, Field(gt=0.0)] = 2.0  # tis and seq_tis
    ratio_mask_low: NonNegFloat | None = None
    ratio_mask_high: NonNegFloat | None = None
    # Sequence weight = exp(sum | mean of the token log-ratios) (seq_tis, seq_mis; default sum).
    seq_log_ratio: Literal["sum", "mean"] | None = None
    seq_mask_low: NonNegFloat | None = None  # seq_mis keeps weights in [low, high]: 0.5 ...
    seq_mask_high: Annotated[float, Field(gt=0.0)] | None = None  # ... and 2.0 by default
    gspo_clip_low: NonNegFloat | None = None  # GSPO's sequence clip range, 3e-4 ...
    gspo_clip_high: NonNegFloat | None = None  # ... and 4e-4 by default (the paper's)
    # DAPO: refill groups whose rewards are all equal (curriculum.filter_uniform's sampling)
    # and drop from the loss those that remain, counted as dapo/dropped_groups.
    dynamic_sampling: bool = False
    overlong_buffer: NonNegInt = 0  # DAPO's L_cache: soft length penalty in the last N tokens
    overlong_penalty: Annotated[float, Field(gt=0.0)] | None = None  # at max length (1.0)
    kl_coef: NonNegFloat = 0.0
    entropy_coef: float = 0.0
    dpo_coef: NonNegFloat = 0.0
    dpo_beta: Annotated[float, Field(gt=0.0)] = 0.1
    updates_per_batch: PosInt = 1

    @model_validator(mode="after")
    def _check(self) -> AlgorithmSpec:
        lo, hi = self.ratio_mask_low, self.ratio_mask_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError("ratio_mask_low must be < ratio_mask_high")
        for name, modes in MODE_SETTINGS.items():
            if getattr(self, name) is not None and self.importance not in modes:
                wanted = " or ".join(repr(m) for m in modes)
                raise ValueError(f"{name} applies to importance = {wanted}, not "
                                 f"{self.importance!r}: remove it or change importance")
        if self.mode_setting("seq_mask_low") >= self.mode_setting("seq_mask_high"):
            raise ValueError("seq_mask_low must be < seq_mask_high")
        if self.overlong_penalty is not None and not self.overlong_buffer:
            raise ValueError("overlong_penalty needs overlong_buffer > 0 (the number of tokens "
                             "before the length limit where the penalty ramps up)")
        return self

    def mode_setting(self, name: str) -> Any:
        """A mode-specific setting's value, its default when unset."""
        value = getattr(self, name)
        return _MODE_DEFAULTS[name] if value is None else value

    @property
    def overlong_factor(self) -> float:
        return 1.0 if self.overlong_penalty is None else self.overlong_penalty

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), *MODE_SETTINGS, "overlong_penalty")


class ZeroPPSpec(_Strict):
    """DeepSpeed ZeRO++ (stage 3 only): qwZ quantises the weights' all-gather, qgZ the gradients'
    reduce-scatter (4-bit, intra- then inter-node all-to-all), hpZ keeps a secondary weight
    partition of `hpz_partition_size` ranks (a node) so the backward all-gather stays inside
    it. qwZ/qgZ need a GPU (DeepSpeed has no CPU kernels for them); hpZ runs anywhere."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz_partition_size: PosInt = 1

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1


class TrainerSpec(_Strict):
    steps: PosInt = 50
    prompts_per_step: PosInt = 8
    micro_batch_size: PosInt = 16
    zero_stage: Literal[0, 1, 2, 3] = 2
    lr: Annotated[float, Field(gt=0.0)] = 1e-3
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: NonNegInt = 0
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    seed: int = 0
    max_consecutive_nan: PosInt = 3
    eval_every: NonNegInt = 0
    eval_samples: PosInt = 4  # completions per held-out prompt
    # Async actor-learner: generation for step n+k overlaps training of step n (0 = synchronous).
    max_async_steps: NonNegInt = 0
    # Where the async actor runs: a thread of this process, or its own child process (it then
    # does not share the learner's GIL; workers/rl/process_actor.py).
    async_actor: Literal["thread", "process"] = "thread"
    sync_timeout_s: Annotated[float, Field(gt=0.0)] = 300.0  # a stalled weight/batch hand-off
    # "4bit": gradients cross ranks as per-block 4-bit codes with error feedback
    # (workers/rl/grad_compress.py); only where Crucible owns the all-reduce (zero_stage 0).
    grad_compression: Literal["none", "4bit"] = "none"
    zeropp: ZeroPPSpec = ZeroPPSpec()

    @model_validator(mode="after")
    def _check(self) -> TrainerSpec:
        if self.grad_compression != "none" and self.zero_stage != 0:
            raise ValueError(
                f"grad_compression = {self.grad_compression!r} needs zero_stage = 0: under "
                f"ZeRO stage {self.zero_stage} DeepSpeed owns the gradient communication (use "
                "trainer.zeropp.quantized_gradients with zero_stage = 3 on GPUs instead)")
        if self.zeropp.enabled and self.zero_stage != 3:
            raise ValueError("trainer.zeropp (ZeRO++) needs zero_stage = 3")
        if self.async_actor == "process" and not self.max_async_steps:
            raise ValueError("trainer.async_actor = 'process' runs the actor beside the "
                             "learner, which needs trainer.max_async_steps >= 1 (0 samples "
                             "inline, synchronously)")
        return self


class MoeSpec(_Strict):
    """Mixture-of-experts training settings (see docs/moe.md).

    `router_replay` (R3): the trainer's forward routes every token the sampler recorded to
    exactly the experts the sampler chose (prompt tokens as routed at prefill, completion
    tokens as routed when fed back), with the routing weights still computed from the
    trainer's own router logits, so the router keeps learning. Checked every micro-batch:
    the routes the forward used must agree with the record on every layer (1.0), else the
    run stops with an error naming the layer. Needs the `hf` rollout backend and single-turn
    objectives: those record routes; vLLM's routed-experts output is not wired yet."""

    router_replay: bool = False
    # Expert balancing (docs/moe.md, "Balanced experts"): "aux" = the Switch loss per
    # micro-batch at model.router_aux_loss_coef (transformers' way); "global_aux" = the same
    # loss with loads counted over the whole step and all ranks; "aux_free" = DeepSeek-V3's
    # per-expert selection bias, moved by bias_rate * sign(mean load - load) each step, no
    # loss; "none" = no balancing. z_loss_coef adds ST-MoE's router z-loss in any mode.
    balance: Literal["aux", "global_aux", "aux_free", "none"] = "aux"
    bias_rate: Annotated[float, Field(gt=0.0)] = 1e-3
    z_loss_coef: NonNegFloat = 0.0
    # Expert parallelism in the RL phase (docs/moe.md, "Expert parallelism"): each layer's
    # experts split over groups of this many consecutive ranks, tokens dispatched by
    # all-to-all; DeepSpeed ZeRO-1/2 reduces expert gradients over the ranks holding the same
    # experts only. 1 = every rank holds every expert. Must divide the world size (checked
    # at start) and the number of experts.
    expert_parallel: PosInt = 1


class CheckpointSpec(_Strict):
    """`dir`: where a local run keeps its checkpoints (default `var/rl/checkpoints`). A run on
    the platform leaves it unset: its worker picks a scratch folder per attempt and the
    checkpoints live in the object store."""

    dir: str | None = None
    every: NonNegInt = 0
    keep: PosInt = 2
    save_final: bool = True

    @property
    def folder(self) -> str:
        return self.dir or DEFAULT_CHECKPOINT_DIR

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "dir")


class OutputSpec(_Strict):
    metrics_jsonl: str | None = None
    stdout: bool = True


class SamplesSpec(_Strict):
    """Samples reported during RL (the run page's samples viewer): `per_step` sequences of
    every `every`-th step, with prompt, completion, reward and components, advantage, weight
    version and finish reason; prompt and completion text capped at `max_bytes` per step."""

    per_step: Annotated[int, Field(ge=0, le=1000)] = 8  # 0: report none
    every: PosInt = 1
    max_bytes: Annotated[int, Field(ge=256, le=4_194_304)] = 32_768


class ClusterSpec(_Strict):
    """The rollout side of a run started on Ray (``workers.cluster``): with `rollout_actors`
    > 0 the ranks stop sampling themselves, and each learner rank gets a rollout actor of its
    own on a placement bundle of its own (`rollout_cpus` / `rollout_gpus` each, placed with
    `rollout_placement`) that runs the rollout backend and hands its batches back; after each
    update the rank pushes its weights to it, versioned, within `push_timeout_s` (buckets of
    `bucket_mb`), and with `verify_pushes` proves each push bitwise with a checksum on both
    ends (a hash over all weights per push: for tests and audits, not for speed). The
    staleness bound is `trainer.max_async_steps`, as in-process (0: every batch is sampled with
    the weights of the step it trains)."""

    rollout_actors: NonNegInt = 0  # 0 or the number of learner ranks (one actor per rank)
    rollout_cpus: Annotated[float, Field(gt=0.0)] = 1.0
    rollout_gpus: NonNegFloat = 0.0  # 1 for a vLLM engine on its own GPU
    rollout_placement: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    push_timeout_s: Annotated[float, Field(gt=0.0)] = 120.0
    bucket_mb: PosInt = 64
    verify_pushes: bool = False


class RunSpec(_Strict):
    """One RL run. Printed at start and stored next to its checkpoints.

    What it trains on: `environment` (any environment spec the platform accepts: a built-in,
    uploaded tasks with a rubric, a `verifiers` module), or `task` (the settings of the built-in
    arithmetic objective), or, with neither, the arithmetic objective's defaults. On the
    platform the pinned environment versions take that place, and the launch refuses both
    fields there."""

    name: str = "run"
    model: ModelSpec = ModelSpec()
    tokenizer: TokenizerSpec = TokenizerSpec()
    task: ArithmeticSpec | None = None
    environment: dict[str, Any] | None = None
    rollout: RolloutSpec = RolloutSpec()
    sft: SftSpec = SftSpec()
    preference: PreferenceSpec = PreferenceSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    moe: MoeSpec = MoeSpec()
    curriculum: CurriculumSpec = CurriculumSpec()
    triage: TriageSpec = TriageSpec()
    trainer: TrainerSpec = TrainerSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()
    samples: SamplesSpec = SamplesSpec()
    data: DataCacheSpec = DataCacheSpec()
    vllm: VllmSpec = VllmSpec()
    cluster: ClusterSpec | None = None  # only for runs started on Ray
    # On the platform: the team's eval suite (its slug) that evaluates every checkpoint this
    # run records and gates their promotion (apps.evals); the engine itself ignores it.
    eval_suite: Annotated[str, Field(pattern=r"^[-a-zA-Z0-9_]{1,64}$")] | None = None

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, value: Any) -> Any:
        """Validated as the platform validates an environment version."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("environment must be a table: an environment spec such as "
                             "{source = 'builtin', name = 'math'}")
        if "tasks_file" in value:
            raise ValueError("tasks_file is read by `python -m workers.rl` (load_spec) from "
                             "the config's folder; pass the tasks inline as environment.tasks")
        doc = value if "env" in value else {"env": value}  # the source table, or the document
        try:
            parsed = EnvironmentSpec.model_validate(doc)
        except ValidationError as err:
            source = doc["env"].get("source") if isinstance(doc["env"], dict) else None

            def where(loc: tuple[Any, ...]) -> str:
                parts = list(loc[1:])  # past "env", and past the union's tag
                if parts and parts[0] == source:
                    parts = parts[1:]
                return "".join(f"{p}." for p in parts).rstrip(".") + ": " if parts else ""

            raise ValueError("; ".join(f"{where(e['loc'])}{e['msg'].removeprefix('Value error, ')}"
                                       for e in err.errors())) from None
        return parsed.env.model_dump(mode="json")

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        if self.task is not None and self.environment is not None:
            raise ValueError("give task (the built-in arithmetic task) or environment, not both")
        if self.tokenizer.source == "model" and self.model.source == "preset":
            raise ValueError("tokenizer.source = 'model' needs model.source = 'path'")
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer = {self.algorithm.overlong_buffer} "
                             f"exceeds rollout.max_new_tokens = "
                             f"{self.rollout.max_new_tokens}: the penalty ramps over the last "
                             "overlong_buffer tokens before that limit")
        if (self.rollout.backend == "vllm" and self.trainer.max_async_steps
                and not (self.cluster and self.cluster.rollout_actors)):
            # The in-process async actor samples from its own HF copy; pushing its versions
            # into vLLM is wired only for rollout actors on Ray (cluster.rollout_actors).
            raise ValueError("rollout.backend = 'vllm' runs synchronously for now: set "
                             "trainer.max_async_steps = 0")
        if self.trainer.async_actor == "process" and self.cluster and \
                self.cluster.rollout_actors:
            raise ValueError("cluster.rollout_actors already runs each rank's actor in its own "
                             "process (on Ray): drop trainer.async_actor = 'process'")
        if self.moe.router_replay and self.rollout.backend == "vllm":
            # vLLM's routed-experts output (enable_return_routed_experts) changed shape and
            # requirements between releases and could not be verified against an installed
            # vLLM here, so the vLLM backend records no routes: replay would have none.
            raise ValueError("moe.router_replay needs recorded routes, which only the 'hf' "
                             "rollout backend records for now: the vLLM backend's "
                             "routed-experts output is not wired (it could not be verified "
                             "against an installed vLLM); use rollout.backend = 'hf' or "
                             "moe.router_replay = false")
        if self.rollout.engine == "continuous":
            if self.rollout.backend != "hf":
                raise ValueError("rollout.engine = 'continuous' schedules the 'hf' backend; "
                                 "vLLM schedules its own rows: drop rollout.engine")
            if self.trainer.zero_stage == 3 or self.moe.expert_parallel > 1:
                raise ValueError("rollout.engine = 'continuous' cannot run ZeRO-3 or expert "
                                 "parallelism, whose ranks must run the same forwards in "
                                 "lockstep: use rollout.engine = 'batch'")
        if self.moe.expert_parallel > 1:
            self._check_expert_parallel()
        if self.moe.balance == "aux_free" and self.rollout.backend == "vllm":
            # vLLM's Qwen3-MoE router has no selection bias: it would sample with other
            # experts than the trainer selects.
            raise ValueError("moe.balance = 'aux_free' needs the 'hf' rollout backend: the "
                             "vLLM backend's router cannot apply the per-expert selection "
                             "bias; use rollout.backend = 'hf' or another moe.balance")
        return self

    def _check_expert_parallel(self) -> None:
        """Refuse `moe.expert_parallel` combinations that cannot train correctly."""
        ep, ts = self.moe.expert_parallel, self.trainer
        where = f"moe.expert_parallel = {ep}"
        if self.model.source == "preset" and self.model.preset.num_experts % ep:
            raise ValueError(f"{where} must divide the number of experts "
                             f"(model.preset.num_experts = {self.model.preset.num_experts}): "
                             "each rank of an expert-parallel group holds an equal share")
        if ts.zero_stage == 3:
            raise ValueError(f"{where} needs trainer.zero_stage 0, 1 or 2: DeepSpeed refuses "
                             "its MoE layers under ZeRO-3 (stage 3 would partition the expert "
                             "shards again over all ranks); use zero_stage = 2")
        if ts.grad_compression != "none":
            raise ValueError(f"{where} cannot use trainer.grad_compression: the 4-bit path "
                             "all-reduces every gradient over all ranks, but expert shards "
                             "must be reduced only over the ranks holding the same experts")
        if self.model.lora is not None:
            raise ValueError(f"{where} with model.lora: LoRA freezes the experts (they cannot "
                             "carry adapters), so there are no expert gradients or optimizer "
                             "state to shard; drop one of the two")
        if self.rollout.backend == "vllm":
            raise ValueError(f"{where} needs rollout.backend = 'hf': the vLLM backend would "
                             "need the gathered experts pushed every step, which is not wired")

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "task", "environment", "cluster")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


class SpecError(ValueError):
    """Invalid run config; the message names every offending field."""


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{field}: {e['msg']}")
    return "invalid run config:\n  " + "\n  ".join(lines)


def parse_spec(data: dict[str, Any]) -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format(err)) from None


def read_tasks_file(path: Path) -> list[Any]:
    """Task records from a JSONL file (one record a line) or a JSON list: what a dataset
    version holds and what an uploaded environment reads."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"invalid run config:\n  environment.tasks_file: cannot read {path}: "
                        f"{exc.strerror}") from None
    try:
        if path.suffix == ".json":
            records = json.loads(text)
            if not isinstance(records, list):
                raise ValueError("a .json tasks file holds a list of task records")
            return records
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (ValueError, json.JSONDecodeError) as exc:
        raise SpecError(f"invalid run config:\n  environment.tasks_file: {path}: {exc}") \
            from None


def load_spec(path: str | Path) -> RunSpec:
    """Read a TOML (or JSON) run config. `environment.tasks_file` (JSONL, or a JSON list; a
    path relative to the config's folder) is read here and inlined as `environment.tasks`, so
    the frozen config holds the tasks the run trained on."""
    p = Path(path)
    text = p.read_text()
    data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    env = data.get("environment") if isinstance(data, dict) else None
    if isinstance(env, dict) and "tasks_file" in env:
        env = dict(env)
        tasks_file = Path(str(env.pop("tasks_file")))
        if "tasks" in env:
            raise SpecError("invalid run config:\n  environment: give tasks_file or tasks, "
                            "not both")
        env["tasks"] = read_tasks_file(tasks_file if tasks_file.is_absolute()
                                       else p.parent / tasks_file)
        data = {**data, "environment": env}
    return parse_spec(data)


# -- the eval run kind ---------------------------------------------------------------------------
# An eval run evaluates an endpoint or a model this engine trained (served through the RL
# rollout path by workers.inference.eval), so its config lives here, above the environment
# engine's EvalParams: workers.envs may not import workers.rl (import-linter layers).

class ServingSpec(_Strict):
    """How the eval worker serves its model: a served variant's settings, the serve command's
    flags (`--int8`, `--ngram-draft`, `--draft-checkpoint`, `--num-speculative-tokens`).
    ``draft`` is given at launch as ``checkpoint:<id>`` or ``run:<id>[@<step>]`` of the same
    team; the launch pins it to that checkpoint's object-store URI."""

    int8: bool = False
    ngram_draft: Annotated[int, Field(ge=0, le=16)] = 0
    draft: Annotated[str, Field(min_length=1, max_length=1000)] | None = None
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)] = 4

    @model_validator(mode="after")
    def _check(self) -> ServingSpec:
        if self.ngram_draft and self.draft is not None:
            raise ValueError("give either ngram_draft or draft (a draft checkpoint), not both")
        return self

    @property
    def default(self) -> bool:
        return self == ServingSpec()


class EvalRunConfig(EvalParams):
    """An ``eval`` run's config: an evaluation of the run's one pinned environment version.

    The policy is either ``policy`` (any OpenAI-compatible endpoint) or a model given at
    launch as ``base_model`` (``preset``: the tiny MoE with a tokenizer trained on the
    environment's tasks; ``run:<id>[@<step>]`` / ``checkpoint:<id>``: an earlier run's
    checkpoint), which the launch writes into ``model`` and the worker serves with the
    inference engine for the evaluation."""

    policy: EndpointPolicySpec | None = None
    model: ModelSpec | None = None
    tokenizer: TokenizerSpec | None = None
    samples: Annotated[int, Field(ge=0, le=10_000, description="per-task answers stored as "
                                                               "run samples")] = 50
    chat_format: Literal["auto", "template", "plain", "raw"] = Field(
        "auto", description="how the served model sees the messages: its tokenizer's chat "
                            "template, 'role: text' lines, or the raw prompt text the RL "
                            "engine trains on; auto = the format the checkpoint records "
                            "(prompt_format.json: raw for what Crucible trained), else the "
                            "template if it has one, else plain. Endpoint policies apply "
                            "their own.")
    serving: ServingSpec = Field(default_factory=ServingSpec, description=(
        "how the worker serves the model (a served variant): int8 weights, speculative "
        "decoding by n-gram lookup or a draft checkpoint; not for endpoint policies"))

    @model_validator(mode="after")
    def _check(self) -> EvalRunConfig:
        if (self.policy is None) == (self.model is None):
            raise ValueError("give exactly one policy: 'policy' (an endpoint) or a model "
                             "(launch with base_model: 'preset', 'run:<id>' or "
                             "'checkpoint:<id>')")
        if self.policy is not None and not self.serving.default:
            raise ValueError("serving settings apply to a model the worker serves, not to an "
                             "endpoint policy (it serves itself)")
        self._check_k()
        return self
