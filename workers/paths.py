"""Where this host keeps Crucible's local state: the one reader of ``CRUCIBLE_VAR_DIR``.

The web process (SQLite file, broker spool, uploads), the Celery app and the workers (object
store default, model cache, run scratch) must agree on the folder, or a worker would look for
objects where the web never wrote them. Standard library only, so ``config`` (which must not
need Django for the Celery app) and the engines both import it.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_VAR_DIR = Path(__file__).resolve().parent.parent / "var"


def var_dir() -> Path:
    """``CRUCIBLE_VAR_DIR`` (blank means unset), else ``var/`` beside the code; made absolute
    so a relative setting still yields ``file://`` URIs for the object store, and created."""
    raw = os.environ.get("CRUCIBLE_VAR_DIR", "").strip()
    path = Path(raw or DEFAULT_VAR_DIR).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
