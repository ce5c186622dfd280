"""One JSON error shape for every failure: ``{"code", "message", "errors"?}``.

Clients (and people) get a message they can act on; field errors keep DRF's structure
under ``errors`` so forms can point at the field.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from apps.core.exceptions import DomainError


def _first_message(errors: Any) -> str:
    """Flatten DRF's nested error dict into one readable sentence naming the field."""
    if isinstance(errors, dict):
        for field, value in errors.items():
            inner = _first_message(value)
            if field in ("non_field_errors", "detail"):
                return inner
            return f"{field}: {inner}"
    if isinstance(errors, list) and errors:
        return _first_message(errors[0])
    return str(errors)


def _too_big_message() -> str:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return (f"The request body is larger than {limit} bytes (DATA_UPLOAD_MAX_MEMORY_SIZE); "
            "send less per request, or upload a dataset as a JSONL file (multipart field "
            "'file'), which streams to disk instead.")


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, RequestDataTooBig):
        return Response({"code": "payload_too_large", "message": _too_big_message()},
                        status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, SuspiciousOperation):  # e.g. too many form fields
        return Response({"code": "bad_request", "message": str(exc) or "Bad request."},
                        status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DomainError):
        body: dict[str, Any] = {"code": exc.code, "message": exc.message}
        if exc.details is not None:
            body["errors"] = exc.details
        return Response(body, status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else exc.messages
        )
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "Not found.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)

    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = {
            "code": "invalid",
            "message": _first_message(exc.detail),
            "errors": exc.detail,
        }
    elif isinstance(exc, exceptions.APIException):
        detail = exc.detail
        code = getattr(detail, "code", None) or exc.default_code
        response.data = {"code": str(code), "message": _first_message(detail)}
    return response


def _json_error(status_code: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"code": code, "message": message}, status=status_code)


def bad_request(request: HttpRequest, exception: Exception):
    """Django's 400 (a SuspiciousOperation outside a DRF view, an oversize body read by
    middleware) in the JSON error shape on API paths. Django always passes the exception."""
    if request.path.startswith("/api/"):
        if isinstance(exception, RequestDataTooBig):
            return _json_error(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, "payload_too_large",
                               _too_big_message())
        return _json_error(status.HTTP_400_BAD_REQUEST, "bad_request",
                           str(exception) or "Bad request.")
    from django.views.defaults import bad_request as default

    return default(request, exception)


def api_not_found(request: HttpRequest) -> JsonResponse:
    """The 404 of an API path that matches no URL. Django's 404 handler is
    ``apps.teams.views.not_found``: its page for the dashboard lists the caller's teams."""
    return _json_error(status.HTTP_404_NOT_FOUND, "not_found", f"No such URL: {request.path}")


def server_error(request: HttpRequest):
    if request.path.startswith("/api/"):
        return _json_error(
            status.HTTP_500_INTERNAL_SERVER_ERROR,
            "server_error",
            "Internal error; it has been logged. Retry, or report it with the time of the request.",
        )
    from django.views.defaults import server_error as default

    return default(request)
