"""Launch validation, one module per concern; :func:`plan_run` is the entry point and
:func:`apps.runs.launch.run_launch` the one caller outside tests."""

from __future__ import annotations

from apps.runs.validation.plan import RunPlan, plan_run
from apps.runs.validation.tags import TAG_PATTERN, validate_tags

__all__ = ["TAG_PATTERN", "RunPlan", "plan_run", "validate_tags"]
