"""``Idempotency-Key`` on POSTs that create work.

The first request with a key runs and its response is stored; a retry with the same key
and the same body gets the stored response; the same key with a different body is a 422.
The handler and the record share one transaction, so a crash stores neither.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from django.core.files import File
from django.db import IntegrityError, transaction
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import Conflict, InvalidInput
from apps.core.models import IdempotencyRecord

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 200


def _scope(request: Request) -> str:
    token = request.auth
    if token is not None and hasattr(token, "prefix"):
        return f"token:{token.prefix}"
    return f"user:{request.user.pk}"


def _encode(value: object) -> str:
    """Uploaded files count by content, not by name: another file is another request."""
    if isinstance(value, File):
        hasher = hashlib.sha256()
        for chunk in value.chunks():
            hasher.update(chunk)
        value.seek(0)
        return f"file:{value.name}:{hasher.hexdigest()}"
    return str(value)


def _hash(request: Request) -> str:
    body = json.dumps(request.data, sort_keys=True, default=_encode)
    return hashlib.sha256(f"{request.method} {request.path}\n{body}".encode()).hexdigest()


def idempotent(request: Request, handler: Callable[[], Response]) -> Response:
    key = request.headers.get(HEADER)
    if not key:
        return handler()
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(f"{HEADER} must be at most {MAX_KEY_LENGTH} characters.")
    scope, digest = _scope(request), _hash(request)
    existing = IdempotencyRecord.objects.filter(scope=scope, key=key).first()
    if existing is not None:
        return _replay(existing, digest)
    try:
        with transaction.atomic():
            response = handler()
            if response.status_code >= 400:
                transaction.set_rollback(True)
                return response
            IdempotencyRecord.objects.create(
                scope=scope,
                key=key,
                request_hash=digest,
                status_code=response.status_code,
                response=response.data,
            )
    except IntegrityError as exc:
        # Another request with this key committed first: replay it.
        existing = IdempotencyRecord.objects.filter(scope=scope, key=key).first()
        if existing is None:
            raise Conflict("A request with this Idempotency-Key is in progress.") from exc
        return _replay(existing, digest)
    return response


def _replay(record: IdempotencyRecord, digest: str) -> Response:
    if record.request_hash != digest:
        raise InvalidInput(
            f"{HEADER} '{record.key}' was already used with a different request; "
            "use a new key for a new request.",
            code="idempotency_key_reused",
        )
    response = Response(record.response, status=record.status_code)
    response["Idempotent-Replayed"] = "true"
    return response
