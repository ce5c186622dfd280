"""Which config schema each run kind uses, and which pool runs it by default.

Each kind's schema is owned by its engine's pure ``spec`` module (pydantic, no heavy imports),
and the worker's adapter parses the run with the same class, so the API rejects a bad config
at creation, naming the field, instead of a worker failing later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from workers.profile.spec import ProfileConfig
from workers.qc.spec import QcRunConfig
from workers.rl.spec import EvalRunConfig, RunSpec
from workers.synthesis.spec import SynthesizeRunConfig

# What QC status an environment version needs before a run of a kind may use it:
# "passed" (training on it), "not_failed" (pending is fine, failed is refused), "any" (QC
# itself, which is what turns pending into passed or failed).
QcGate = Literal["passed", "not_failed", "any"]


@dataclass(frozen=True)
class KindSpec:
    schema: type[BaseModel]
    default_pool: str
    datasets: tuple[int, int | None]  # (minimum, maximum) pinned dataset versions
    environments: tuple[int, int | None] = (0, 1)  # (minimum, maximum) environment versions
    qc_gate: QcGate = "not_failed"
    # Whether the run starts from a model (``base_model`` at launch: preset, directory or an
    # earlier run's checkpoint), written into ``config.model`` by the launch.
    base_model: bool = False


KINDS: dict[str, KindSpec] = {
    "profile": KindSpec(ProfileConfig, "cpu", (1, 1)),
    # The pinned environment versions (QC passed) are the tasks it trains on; with none, the
    # engine's own config.task. Pinned datasets are recorded in the lineage.
    "train": KindSpec(RunSpec, "gpu", (0, None), environments=(0, None), qc_gate="passed",
                      base_model=True),
    # QC of one environment version (any QC status: QC is what sets it); code environments
    # run their probes in the sandbox, hence the sandbox pool.
    "qc": KindSpec(QcRunConfig, "sandbox", (0, 0), environments=(1, 1), qc_gate="any"),
    # Evaluation of one version (not failed QC) by an endpoint or a model given as base_model.
    "eval": KindSpec(EvalRunConfig, "cpu", (0, 0), environments=(1, 1), base_model=True),
    # Synthesis into a review batch of config.dataset; no pins.
    "synthesize": KindSpec(SynthesizeRunConfig, "cpu", (0, None), environments=(0, 0)),
}


def available_kinds() -> list[str]:
    return sorted(KINDS)
