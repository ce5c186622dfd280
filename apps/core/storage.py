"""The configured object store, opened once per process."""

from __future__ import annotations

from functools import cache

from django.conf import settings

from workers.storage import LocalStore, S3Store, open_store


@cache
def store() -> LocalStore | S3Store:
    return open_store(settings.OBJECT_STORE_URL)
