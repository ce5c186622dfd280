"""The client's exceptions cross process boundaries (Celery pickles a task's exception for
its logs and result): they must come back as themselves, fields intact."""

from __future__ import annotations

import pickle

import pytest

from workers.client import ApiError, LeaseLost


@pytest.mark.parametrize("cls", [ApiError, LeaseLost])
def test_client_errors_round_trip_through_pickle(cls: type[ApiError]) -> None:
    body = {"code": "lease_expired", "message": "The lease expired.", "errors": {"x": [1]}}
    error = cls(409, "lease_expired", "The lease expired.", body)
    error.add_note("while reporting metrics")

    again = pickle.loads(pickle.dumps(error))

    assert type(again) is cls
    assert (again.status, again.code, again.message, again.body) == (
        409, "lease_expired", "The lease expired.", body)
    assert str(again) == str(error) == "409 lease_expired: The lease expired."
    assert again.__notes__ == ["while reporting metrics"]


def test_client_error_without_body_round_trips() -> None:
    again = pickle.loads(pickle.dumps(ApiError(503, "error", "down")))
    assert (again.status, again.code, again.message, again.body) == (503, "error", "down", None)


def test_celery_keeps_the_real_error() -> None:
    """What Celery does with a task's exception before logging it: an exception that does
    not survive pickling is swapped for an ``UnpickleableExceptionWrapper``."""
    from celery.utils.serialization import get_pickleable_exception

    error = LeaseLost(409, "run_not_active", "The run was canceled.")
    assert get_pickleable_exception(error) is error
