"""Is this node's sandbox fit for a claimed run's environments? Probed before the run starts
and again after it fails (workers.sandbox.health): a broken sandbox or toolchain is the
node's problem, reported as an ``environment`` failure (the control plane queues the run
again, counts it against the node and asks the node to re-check), not the run's own."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from workers.client import WorkerSession
from workers.envs.spec import sandbox_languages
from workers.protocol import ClaimedRun

log = logging.getLogger(__name__)


def needed_languages(run: ClaimedRun) -> list[str]:
    """The sandbox languages the run's pinned environments execute."""
    specs = [e.spec for e in run.environments] or (
        [run.environment.spec] if run.environment is not None else [])
    found: set[str] = set()
    for spec in specs:
        found |= sandbox_languages(spec)
    return sorted(found)


@dataclass(frozen=True)
class Broken:
    """A failed probe, as the status report carries it."""

    message: str
    toolchains: dict[str, dict[str, Any]]


def check(run: ClaimedRun, node: str) -> Broken | None:
    """Probe what the run needs (rebuilding the sandbox state once if a probe fails); None
    when every language passed or the run needs none."""
    wanted = needed_languages(run)
    if not wanted:
        return None
    from workers.sandbox.health import probe_or_rebuild  # the engine: only runs that need it

    try:
        found = probe_or_rebuild(wanted)
    except Exception:  # noqa: BLE001 - a probe that cannot run must not hide the run's report
        log.exception("run %s: the sandbox probe itself failed", run.id)
        return None
    failed = {name: c for name, c in found.items() if not c.ok}
    if not failed:
        return None
    details = "; ".join(c.detail for c in failed.values())
    message = (f"the sandbox cannot run {', '.join(sorted(failed))} on node {node}, which "
               f"this run's environments need: {details}")
    log.warning("run %s: %s", run.id, message)
    return Broken(message, {name: {"ok": c.ok, "detail": c.detail}
                            for name, c in found.items()})


def report(session: WorkerSession, broken: Broken, node: str) -> None:
    """Tell the control plane: an environment failure on this node, not the run's own."""
    session.set_status("failed", broken.message, retry=True, cause="environment", node=node,
                       toolchains=broken.toolchains)
