"""Size limits on what people and workers send, in one place.

Every free-text field has a maximum length (serializers declare it; services re-check the
ones the dashboard's forms also write), and every free-form JSON document a maximum encoded
size, so one request cannot park megabytes in a description or a config. Over a limit is a
400 naming the field and the limit.
"""

from __future__ import annotations

from typing import Any

import orjson

from apps.core.exceptions import InvalidInput

NAME = 200  # names and titles
DESCRIPTION = 10_000  # project, dataset, environment descriptions
REASON = 2_000  # review verdict and rollback reasons
MESSAGE = 10_000  # event messages, run errors
REF = 200  # slug@version references, digests, version names
SAMPLE_TEXT = 200_000  # one sample's prompt or completion (model output can be long)

CONFIG_BYTES = 256 * 1024  # a run's config document
SPEC_BYTES = 16 * 1024 * 1024  # an environment spec (uploaded tasks travel inside it)
MANIFEST_BYTES = 1024 * 1024  # a batch's or version's manifest
SMALL_JSON_BYTES = 64 * 1024  # event data, checkpoint metrics, reward components
REPORT_BYTES = 8 * 1024 * 1024  # a QC report summary


def check_text(value: str, *, field: str, limit: int) -> str:
    if len(value) > limit:
        raise InvalidInput(f"{field} is {len(value)} characters; at most {limit} are allowed.",
                           details={field: [f"at most {limit} characters"]})
    return value


def check_json(value: Any, *, field: str, limit: int) -> Any:
    try:
        size = len(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS))
    except (TypeError, orjson.JSONEncodeError):
        return value  # not ours to judge here: the caller's validation names the problem
    if size > limit:
        raise InvalidInput(f"{field} is {size} bytes of JSON; at most {limit} are allowed.",
                           details={field: [f"at most {limit} bytes"]})
    return value
