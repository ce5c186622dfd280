"""Environment-variable configuration shared by Django settings and the Celery app.

The Celery app must not need Django (workers hold no database credentials), so the
broker and object-store settings are read here with ``os.environ`` alone; django-environ
(which imports Django) parses the rest in ``config.settings``. The var folder comes from
:mod:`workers.paths`, the one reader of ``CRUCIBLE_VAR_DIR``, so workers agree with the web.
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.paths import var_dir

BASE_DIR = Path(__file__).resolve().parent.parent


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def redis_url() -> str | None:
    return _get("REDIS_URL")


def broker_url() -> str:
    """Celery broker: explicit CELERY_BROKER_URL, else REDIS_URL, else the filesystem spool."""
    explicit = _get("CELERY_BROKER_URL")
    if explicit:
        return explicit
    return redis_url() or "filesystem://"


def broker_transport_options(url: str | None = None) -> dict[str, object]:
    """Options for the broker at ``url`` (default: the configured one): the filesystem
    transport's spool folders; publisher confirms on AMQP, so a publish returns once RabbitMQ
    has routed the message to its queue (a task sent just before the broker drops is not lost
    silently, and a count taken after a publish sees it); nothing for Redis."""
    url = url or broker_url()
    if url.startswith(("amqp://", "amqps://", "pyamqp://")):
        return {"confirm_publish": True}
    if not url.startswith("filesystem://"):
        return {}
    spool = var_dir() / "broker"
    for sub in ("queue", "processed", "control"):
        (spool / sub).mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(spool / "queue"),
        "data_folder_out": str(spool / "queue"),
        "processed_folder": str(spool / "processed"),
        "store_processed": False,
        # Exchange bindings; kombu's default is ./control in the current directory.
        "control_folder": str(spool / "control"),
    }


def object_store_url() -> str:
    """``file:///abs/path`` (default ``var/objects``) or ``s3://bucket/prefix``."""
    default = (var_dir() / "objects").as_uri()
    return _get("OBJECT_STORE_URL", default) or default


def scheduler_enabled() -> bool:
    """``CRUCIBLE_SCHEDULER`` as django-environ reads it for ``settings.CRUCIBLE["SCHEDULER"]``
    (the Celery beat, which has no Django, needs the same answer to schedule the pass)."""
    return (_get("CRUCIBLE_SCHEDULER") or "").lower() in ("true", "on", "ok", "y", "yes", "1")
