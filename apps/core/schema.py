"""OpenAPI post-processing: every operation documents the error responses it can give.

Views declare their success responses; the failures are the same everywhere (the one JSON
error shape of ``apps.core.errors``), so they are added here once rather than on each view:
400 bad input, 401 no or bad credentials, 403 role or token kind, 404 not found (or not
yours), 405 method, 409 conflict, 413 too large, 415 media type, 429 throttled or over
quota (with Retry-After); 503 where a view calls another service (``SERVICE_ERRORS``).
A schema that lists them is one clients and schemathesis can
hold the API to.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema

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

# Operations that call another service synchronously, by path fragment: their 503.
SERVICE_ERRORS = {
    "/sandbox-sessions/": "The session host is unreachable (code session_host_unavailable): "
                          "the workspace is unchanged; retry when it is back.",
    "/sandbox-snapshots/": "The session host is unreachable (code session_host_unavailable); "
                           "retry when it is back.",
}


def add_error_responses(result: dict[str, Any], generator: Any, request: Any,
                        public: bool) -> dict[str, Any]:
    """drf-spectacular POSTPROCESSING_HOOK."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    ref = {"$ref": "#/components/schemas/Error"}
    retry_after = {"Retry-After": {"schema": {"type": "integer"},
                                   "description": "seconds to wait"}}
    for path, operations in result.get("paths", {}).items():
        errors = dict(ERRORS)
        for fragment, text in SERVICE_ERRORS.items():
            if fragment in path:
                errors["503"] = text
        for method, operation in operations.items():
            if method not in ("get", "post", "put", "patch", "delete", "head", "options"):
                continue
            responses = operation.setdefault("responses", {})
            for status, description in errors.items():
                if status in responses:
                    continue
                body: dict[str, Any] = {"description": description,
                                        "content": {"application/json": {"schema": ref}}}
                if status == "429":
                    body["headers"] = retry_after
                responses[status] = body
    return result


def _as_openapi_30(node: Any) -> Any:
    """One JSON Schema 2020-12 node (what pydantic writes) in OpenAPI 3.0's dialect: an
    ``anyOf`` with ``{"type": "null"}`` becomes ``nullable``, ``const`` a one-value enum."""
    if isinstance(node, list):
        return [_as_openapi_30(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _as_openapi_30(v) for k, v in node.items()}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    options = node.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        del node["anyOf"]
        if len(rest) == 1 and "$ref" not in rest[0]:
            node = {**rest[0], **node}
        else:
            node["anyOf" if len(rest) > 1 else "allOf"] = rest
        node["nullable"] = True
    return node


def protocol_schemas(result: dict[str, Any], generator: Any, request: Any,
                     public: bool) -> dict[str, Any]:
    """drf-spectacular POSTPROCESSING_HOOK: the worker protocol's models
    (:mod:`workers.protocol`, documented from pydantic) in the document's OpenAPI 3.0.
    Serializer components hold neither construct, so every component passes through."""
    schemas = result.get("components", {}).get("schemas", {})
    for name, schema in schemas.items():
        schemas[name] = _as_openapi_30(schema)
    return result


class OneDocumentSchema(AutoSchema):
    """For a viewset whose ``list`` route answers one document, not a list of objects
    (e.g. a team's usage): drf-spectacular would describe it as an array."""

    def _is_list_view(self, serializer: Any = None) -> bool:
        return False
