"""The typed config of one synthesis run.

Pure pydantic and the standard library, so the control plane validates a `synthesize` run's config
at creation without importing sympy, datasketch or the sandbox. Unknown fields are errors.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MATH_TOPICS: tuple[str, ...] = (
    "arithmetic", "linear", "quadratic", "system", "derivative", "integral",
    "gcd", "modular", "primes",
)
"""Symbolic math topics; gcd, modular and primes are the number-theory family."""

CODE_FAMILIES: tuple[str, ...] = (
    "count_divisible", "caesar", "kth_smallest", "brackets", "max_subarray",
    "coin_change", "lis", "grid_paths", "edit_distance",
)
"""Algorithmic task families; each has a reference and an independent brute-force solution."""

PERTURBATIONS: tuple[str, ...] = ("rename", "renumber", "distract")

Difficulty = Annotated[int, Field(ge=1, le=5)]
PosInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_M = TypeVar("_M", bound=BaseModel)


def _difficulties(values: list[int]) -> list[int]:
    if not values:
        raise ValueError("difficulties must not be empty")
    return sorted(set(values))


class MathGenerator(_Strict):
    """Symbolic problems built with sympy, answers verified by re-derivation."""

    kind: Literal["math"] = "math"
    count: Annotated[int, Field(ge=0, le=1_000_000)] = 100
    topics: list[Literal[MATH_TOPICS]] = list(MATH_TOPICS)  # type: ignore[valid-type]
    difficulties: list[Difficulty] = [1, 2, 3, 4, 5]

    @model_validator(mode="after")
    def _check(self) -> MathGenerator:
        if not self.topics:
            raise ValueError("math.topics must not be empty")
        object.__setattr__(self, "difficulties", _difficulties(self.difficulties))
        return self


class CodeGenerator(_Strict):
    """Algorithmic stdin/stdout tasks; expected outputs come from the reference in the sandbox."""

    kind: Literal["code"] = "code"
    count: Annotated[int, Field(ge=0, le=100_000)] = 10
    families: list[Literal[CODE_FAMILIES]] = list(CODE_FAMILIES)  # type: ignore[valid-type]
    difficulties: list[Difficulty] = [1, 2, 3, 4, 5]
    tests_per_item: Annotated[int, Field(ge=1, le=50)] = 5

    @model_validator(mode="after")
    def _check(self) -> CodeGenerator:
        if not self.families:
            raise ValueError("code.families must not be empty")
        object.__setattr__(self, "difficulties", _difficulties(self.difficulties))
        return self


class Endpoint(_Strict):
    """An OpenAI-compatible chat-completions server (ours or one the user configures)."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1")
    model: str
    api_key: str | None = Field(None, description="sent as a bearer token; never stored")
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    max_tokens: Annotated[int, Field(ge=1, le=8192)] = 256
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.0
    concurrency: Annotated[int, Field(ge=1, le=64)] = 2

    @model_validator(mode="after")
    def _check(self) -> Endpoint:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("endpoint.base_url must start with http:// or https://")
        return self


class ModelGenerator(_Strict):
    """Model-driven items: paraphrase or add multiple-choice distractors to verified math items,
    or write new problems; every output goes through the same verification."""

    kind: Literal["model"] = "model"
    count: Annotated[int, Field(ge=0, le=100_000)] = 10
    mode: Literal["paraphrase", "distractors", "new"] = "paraphrase"
    endpoint: Endpoint
    topics: list[Literal[MATH_TOPICS]] = ["arithmetic", "linear", "quadratic", "gcd"]  # type: ignore[valid-type]
    difficulties: list[Difficulty] = [1, 2, 3]

    @model_validator(mode="after")
    def _check(self) -> ModelGenerator:
        if not self.topics:
            raise ValueError("model.topics must not be empty")
        object.__setattr__(self, "difficulties", _difficulties(self.difficulties))
        return self


class AdversarialGenerator(_Strict):
    """Perturbed variants of freshly generated, verified items, verified again."""

    kind: Literal["adversarial"] = "adversarial"
    count: Annotated[int, Field(ge=0, le=1_000_000)] = 20
    source: Literal["math", "code"] = "math"
    perturbations: list[Literal[PERTURBATIONS]] = list(PERTURBATIONS)  # type: ignore[valid-type]
    topics: list[Literal[MATH_TOPICS]] = list(MATH_TOPICS)  # type: ignore[valid-type]
    families: list[Literal[CODE_FAMILIES]] = list(CODE_FAMILIES)  # type: ignore[valid-type]
    difficulties: list[Difficulty] = [1, 2, 3, 4, 5]
    tests_per_item: Annotated[int, Field(ge=1, le=50)] = 5

    @model_validator(mode="after")
    def _check(self) -> AdversarialGenerator:
        if not self.perturbations:
            raise ValueError("adversarial.perturbations must not be empty")
        object.__setattr__(self, "difficulties", _difficulties(self.difficulties))
        return self


GeneratorSpec = Annotated[
    MathGenerator | CodeGenerator | ModelGenerator | AdversarialGenerator,
    Field(discriminator="kind"),
]


class DedupSpec(_Strict):
    """Exact duplicates by normalised text; near duplicates by MinHash LSH on word shingles."""

    near: bool = True
    threshold: Annotated[float, Field(gt=0, le=1)] = 0.8
    num_perm: Annotated[int, Field(ge=16, le=512)] = 128
    shingle: Annotated[int, Field(ge=1, le=8)] = 3


class SynthesisConfig(_Strict):
    """One synthesis run: generators, seed and quality settings. Stored in the batch manifest."""

    name: str = Field("synthesis", max_length=200)
    seed: int = 0
    generators: list[GeneratorSpec] = Field(min_length=1, max_length=32)
    dedup: DedupSpec = DedupSpec()
    distinct_n: list[Annotated[int, Field(ge=1, le=8)]] = [1, 2, 3]
    workers: Annotated[int, Field(ge=1, le=64)] = 2
    sandbox_concurrency: Annotated[int, Field(ge=1, le=64)] = 2
    parents: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        default_factory=list, description="dataset version ids this batch derives from")

    @model_validator(mode="after")
    def _check(self) -> SynthesisConfig:
        if sum(g.count for g in self.generators) == 0:
            raise ValueError("generators ask for 0 items in total")
        return self

    def public_dict(self) -> dict[str, Any]:
        """The config as stored in a manifest: endpoint keys are never written down."""
        data = self.model_dump(mode="json")
        for gen in data["generators"]:
            if gen.get("endpoint", {}).get("api_key"):
                gen["endpoint"]["api_key"] = "***"
        return data

    def to_json(self) -> str:
        return json.dumps(self.public_dict(), indent=2, sort_keys=True)


class ReviewPlan(_Strict):
    """How the review app spot-checks the batch (acceptance sampling)."""

    target_error_rate: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.05
    confidence: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.95
    sample_seed: int | None = None


class SynthesizeRunConfig(_Strict):
    """A ``synthesize`` run's config: its verified records become a review batch for
    ``dataset`` (a dataset of the run's team); accepted batches become that dataset's
    versions."""

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


class SpecError(ValueError):
    """Invalid synthesis config; the message names every offending field."""


def _parse(model: type[_M], data: Any, what: str) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                 for e in err.errors()]
        raise SpecError(f"invalid {what}:\n  " + "\n  ".join(lines)) from None


def parse_config(data: dict[str, Any]) -> SynthesisConfig:
    return _parse(SynthesisConfig, data, "synthesis config")


def parse_run_config(data: dict[str, Any]) -> SynthesizeRunConfig:
    """A synthesize run's stored config, as the launch validated it."""
    return _parse(SynthesizeRunConfig, data, "synthesize run config")
