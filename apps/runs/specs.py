"""Which config schema each run kind uses, and which pool runs it by default.

Schemas come from the engines' pure ``spec`` modules (pydantic, no heavy imports), so the
API rejects a bad config at creation, naming the field, instead of a worker failing later.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from workers.profile.spec import ProfileConfig
from workers.rl.spec import RunSpec


@dataclass(frozen=True)
class KindSpec:
    schema: type[BaseModel]
    default_pool: str
    datasets: tuple[int, int | None]  # (minimum, maximum) pinned dataset versions


KINDS: dict[str, KindSpec] = {
    "profile": KindSpec(ProfileConfig, "cpu", (1, 1)),
    # The RL engine's task source is built in (arithmetic) until environments land.
    "train": KindSpec(RunSpec, "gpu", (0, None)),
}


def available_kinds() -> list[str]:
    return sorted(KINDS)
