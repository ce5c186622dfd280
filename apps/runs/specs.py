"""Which config schema each run kind uses, and which pool runs it by default.

Schemas come from the engines' pure ``spec`` modules (pydantic, no heavy imports), so the
API rejects a bad config at creation, naming the field, instead of a worker failing later.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from workers.profile.spec import ProfileConfig


@dataclass(frozen=True)
class KindSpec:
    schema: type[BaseModel]
    default_pool: str
    datasets: tuple[int, int | None]  # (minimum, maximum) pinned dataset versions


KINDS: dict[str, KindSpec] = {
    "profile": KindSpec(ProfileConfig, "cpu", (1, 1)),
}


def available_kinds() -> list[str]:
    return sorted(KINDS)
