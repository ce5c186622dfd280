"""Domain errors raised by services; ``apps.core.errors`` turns them into JSON responses.

Services raise these instead of DRF exceptions so they stay usable from management
commands, admin actions and tests without an HTTP request.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    status_code = 400
    code = "invalid"

    def __init__(self, message: str, *, code: str | None = None, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.details = details


class InvalidInput(DomainError):
    status_code = 400
    code = "invalid"


class NotFound(DomainError):
    status_code = 404
    code = "not_found"


class Forbidden(DomainError):
    status_code = 403
    code = "forbidden"


class Conflict(DomainError):
    status_code = 409
    code = "conflict"


class IllegalTransition(Conflict):
    code = "illegal_transition"


class LeaseError(Conflict):
    code = "lease_invalid"


class PayloadTooLarge(DomainError):
    status_code = 413
    code = "payload_too_large"
