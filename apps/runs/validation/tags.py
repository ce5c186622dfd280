"""Run tags: the one pattern the launch, the runs filter and the dashboard all check."""

from __future__ import annotations

import re
from typing import Any

from apps.core.exceptions import InvalidInput

MAX_TAGS = 16
TAG_MAX_LENGTH = 40
TAG_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def validate_tags(tags: Any) -> list[str]:
    """Tags as given, each once in first-seen order; refused whole (naming the first bad
    one) so a launch never keeps some tags and drops others."""
    if tags is None:
        return []
    if not isinstance(tags, list | tuple):
        raise InvalidInput("tags must be a list of strings.", details={"tags": ["list"]})
    if len(tags) > MAX_TAGS:
        raise InvalidInput(f"tags: at most {MAX_TAGS} tags per run; got {len(tags)}.",
                           details={"tags": [f"{len(tags)} given"]})
    clean: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            shown = repr(tag)[:60]
            raise InvalidInput(
                f"tags: {shown} is not a tag; a tag is 1 to {TAG_MAX_LENGTH} letters, digits, "
                "'-', '_' or '.'.",
                details={"tags": [shown]},
            )
        if tag not in clean:
            clean.append(tag)
    return clean
