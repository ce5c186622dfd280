"""Config schemas of the run kinds around environments: ``qc``, ``eval`` and ``synthesize``.

Pure pydantic composed from the engines' pure spec modules, so a launch is validated (errors
naming the field) without importing an engine. The worker side (``workers/adapters/``) reads
the same documents with the engines' own models.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.envs.spec import EndpointPolicySpec, SamplingSpec, Split
from workers.qc.spec import QcSpec
from workers.rl.spec import ModelSpec, TokenizerSpec
from workers.synthesis.spec import SynthesisConfig

PosInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QcRunConfig(_Strict):
    """A QC run of the one pinned environment version; its report sets the version's
    qc_status (passed, or failed with the block reasons)."""

    qc: QcSpec = QcSpec()


class EvalRunConfig(_Strict):
    """An evaluation of the one pinned environment version.

    The policy is either ``policy`` (any OpenAI-compatible endpoint) or a model given at
    launch as ``base_model`` (``preset``: the tiny MoE with a tokenizer trained on the
    environment's tasks; ``run:<id>[@<step>]`` / ``checkpoint:<id>``: an earlier run's
    checkpoint), which the launch writes into ``model`` and the worker serves with the
    inference engine for the evaluation."""

    policy: EndpointPolicySpec | None = None
    model: ModelSpec | None = None
    tokenizer: TokenizerSpec | None = None
    split: Split = "eval"
    samples_per_task: Annotated[int, Field(ge=1, le=256)] = 1
    k: list[PosInt] = Field(default_factory=lambda: [1])
    limit: PosInt | None = None
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    sampling: SamplingSpec = SamplingSpec()
    samples: Annotated[int, Field(ge=0, le=10_000, description="per-task answers stored as "
                                                               "run samples")] = 50
    chat_format: Literal["auto", "template", "plain", "raw"] = Field(
        "auto", description="how the served model sees the messages: its tokenizer's chat "
                            "template, 'role: text' lines, or the raw prompt text the RL "
                            "engine trains on; auto = the format the checkpoint records "
                            "(prompt_format.json: raw for what Crucible trained), else the "
                            "template if it has one, else plain. Endpoint policies apply "
                            "their own.")

    @model_validator(mode="after")
    def _check(self) -> EvalRunConfig:
        if (self.policy is None) == (self.model is None):
            raise ValueError("give exactly one policy: 'policy' (an endpoint) or a model "
                             "(launch with base_model: 'preset', 'run:<id>' or "
                             "'checkpoint:<id>')")
        too_big = [k for k in self.k if k > self.samples_per_task]
        if too_big:
            raise ValueError(f"pass@k needs k <= samples_per_task ({self.samples_per_task}); "
                             f"got k={too_big}")
        return self


class ReviewPlan(_Strict):
    """How the review app spot-checks the batch (acceptance sampling)."""

    target_error_rate: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.05
    confidence: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.95
    sample_seed: int | None = None


class SynthesizeRunConfig(_Strict):
    """A synthesis run: its verified records become a review batch for ``dataset`` (a
    dataset of the run's team); accepted batches become that dataset's versions."""

    dataset: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[-a-zA-Z0-9_]+$")]
    synthesis: SynthesisConfig
    review: ReviewPlan = ReviewPlan()
    batch_name: Annotated[str, Field(max_length=200)] = ""

    @model_validator(mode="after")
    def _no_keys(self) -> SynthesizeRunConfig:
        # A run's config is stored and shown to the whole team: no secrets in it.
        keyed = [i for i, g in enumerate(self.synthesis.generators)
                 if getattr(getattr(g, "endpoint", None), "api_key", None)]
        if keyed:
            raise ValueError(f"synthesis.generators {keyed}: endpoint.api_key would be stored "
                             "in the run's config, which the team can read; serve the model "
                             "without a key (e.g. Crucible's inference server) instead")
        return self
