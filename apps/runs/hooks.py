"""Extension points for the apps above runs.

``apps.evals`` sits above runs in the app layers (import-linter), so runs may not import it;
it registers plain callables here from its ``AppConfig.ready()`` instead. Explicit lists, not
Django signals: a reader of ``services`` sees every call site (``checkpoint_added``,
``run_finished``, ``check_launch``), and a hook's failure after commit is logged, never lost
silently and never undoing the worker's report it follows.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Called after commit with the id of a checkpoint just recorded (once per checkpoint).
CHECKPOINT_ADDED: list[Callable[[int], None]] = []
#: Called after commit with the id of a run that reached succeeded, failed or canceled.
RUN_FINISHED: list[Callable[[uuid.UUID], None]] = []
#: Called while a launch is validated: (team, kind, normalized config); raise InvalidInput.
LAUNCH_CHECKS: list[Callable[[Any, str, dict[str, Any]], None]] = []


def checkpoint_added(checkpoint_id: int) -> None:
    for hook in CHECKPOINT_ADDED:
        try:
            hook(checkpoint_id)
        except Exception:  # noqa: BLE001 - the checkpoint is recorded; the hook logs its own
            log.exception("checkpoint hook %s failed for checkpoint %s", hook, checkpoint_id)


def run_finished(run_id: uuid.UUID) -> None:
    for hook in RUN_FINISHED:
        try:
            hook(run_id)
        except Exception:  # noqa: BLE001 - the run's transition is committed already
            log.exception("run-finished hook %s failed for run %s", hook, run_id)


def check_launch(team: Any, kind: str, config: dict[str, Any]) -> None:
    for check in LAUNCH_CHECKS:
        check(team, kind, config)
