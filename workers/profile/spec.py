"""Config of a ``profile`` run. Pure pydantic: the API validates run configs with it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProfileConfig(BaseModel):
    """Statistics of one pinned dataset version."""

    model_config = ConfigDict(extra="forbid")

    dataset: str | None = Field(
        default=None,
        description="Alias (dataset slug) of the pinned version to profile; "
        "optional when the run pins exactly one dataset.",
    )
    max_records: int | None = Field(
        default=None, ge=1, description="Stop after this many records (default: all)."
    )
    progress_every: int = Field(
        default=1000, ge=1, le=1_000_000, description="Report progress every N records."
    )
    top_values: int = Field(
        default=5, ge=0, le=100, description="Most frequent values kept per string field."
    )
