"""OpenAPI post-processing: every operation documents the error responses it can give.

Views declare their success responses; the failures are the same everywhere (the one JSON
error shape of ``apps.core.errors``), so they are added here once rather than on each view:
400 bad input, 401 no or bad credentials, 403 role or token kind, 404 not found (or not
yours), 405 method, 409 conflict, 413 too large, 415 media type, 429 throttled or over
quota (with Retry-After). A schema that lists them is one clients and schemathesis can
hold the API to.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA = {
    "type": "object",
    "description": "Every error: a code, a sentence naming the problem, field errors.",
    "properties": {
        "code": {"type": "string", "example": "invalid"},
        "message": {"type": "string"},
        "errors": {"description": "per-field messages (for input errors)"},
    },
    "required": ["code", "message"],
}

ERRORS = {
    "400": "Bad input: the message names the field and the problem.",
    "401": "Missing, malformed, unknown, revoked or expired credentials.",
    "403": "Authenticated, but the role or token kind may not do this.",
    "404": "No such object, or not in a team you belong to (the same answer).",
    "405": "Method not allowed on this path.",
    "409": "Conflict with the object's state (e.g. an illegal run transition).",
    "413": "Request body or batch too large.",
    "415": "Unsupported request media type.",
    "429": "Throttled or over a quota; Retry-After says when to try again.",
}


def add_error_responses(result: dict[str, Any], generator: Any, request: Any,
                        public: bool) -> dict[str, Any]:
    """drf-spectacular POSTPROCESSING_HOOK."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    ref = {"$ref": "#/components/schemas/Error"}
    retry_after = {"Retry-After": {"schema": {"type": "integer"},
                                   "description": "seconds to wait"}}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method not in ("get", "post", "put", "patch", "delete", "head", "options"):
                continue
            responses = operation.setdefault("responses", {})
            for status, description in ERRORS.items():
                if status in responses:
                    continue
                body: dict[str, Any] = {"description": description,
                                        "content": {"application/json": {"schema": ref}}}
                if status == "429":
                    body["headers"] = retry_after
                responses[status] = body
    return result
