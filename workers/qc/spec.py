"""A QC run's config and thresholds: pure pydantic, so the control plane validates a launch
without importing the engine, and the worker's adapter reads the run with the same class."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class QcSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    repeats: Annotated[int, Field(ge=1, le=10, description="scorings of each reference (>= 2 "
                                                            "checks determinism)")] = 2
    quarantine_threshold: Annotated[float, Field(
        ge=0.0, le=1.0, description="block the version when the quarantined share exceeds "
                                    "this")] = 0.1
    full_reward: Annotated[float, Field(
        gt=0.0, le=1.0, description="share of the rubric's maximum the reference must "
                                    "earn")] = 1.0
    trivial: bool = Field(True, description="score the environment's trivial answers")
    trivial_max_share: Annotated[float, Field(
        ge=0.0, lt=1.0, description="under partial credit, the share of the partial-credit "
                                    "components' weight a trivial answer may earn on one "
                                    "task (binary components must give it nothing)")] = 0.75
    trivial_mean_share: Annotated[float, Field(
        ge=0.0, lt=1.0, description="under partial credit, the share of that weight the best "
                                    "trivial answer may earn on average over the tasks; above "
                                    "it the version is blocked (a no-effort policy would "
                                    "collect it)")] = 0.5
    perturbations: bool = Field(True, description="score near-miss wrong answers")
    near_duplicate_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.85
    max_task_seconds: Annotated[float, Field(gt=0.0, description="a reference run slower than "
                                                                 "this is quarantined")] = 60.0
    chunk_size: Annotated[int, Field(ge=1, le=100_000)] = 512
    forgeries: bool = Field(True, description="score the library of known reward forgeries "
                                              "(workers/qc/forgeries.py) on code environments")
    forgery_tasks: Annotated[int, Field(
        ge=0, le=100_000, description="tasks the forgeries are tried on (0: every task); the "
                                      "grader is usually shared, so a sample finds it")] = 12


class QcRunConfig(BaseModel):
    """A ``qc`` run's config: QC of the one pinned environment version; its report sets the
    version's qc_status (passed, or failed with the block reasons)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    qc: QcSpec = QcSpec()
