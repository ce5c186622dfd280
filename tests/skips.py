"""Which skips are legitimate, and which mean a dependency `make test` should have installed.

Two kinds of skip, kept apart explicitly:

- **Host skips**: a property of the machine or of the pass that no install can change — no CUDA
  GPU (vLLM), no usable cgroup controllers on this kernel, not running as root, a Redis-only
  test in the SQLite pass, an engine test in the PostgreSQL pass. Their reason starts with
  `HOST` ("host: "); write them with `host_reason(...)` or `host_skip(...)`.
- **Everything else**: a missing package, browser, bubblewrap or toolchain — what `make test`
  installs (`pip install -e .[dev,...]`, `scripts/install_sandbox_deps.sh`,
  `scripts/install_test_deps.sh`). On a developer's machine they stay skips, with the reason;
  under `CI=true` (set by `.ci/run`) the hooks below (a pytest plugin, loaded by
  `tests/conftest.py`) turn each into a failure, so a run that silently tested less than it
  claims cannot pass.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

HOST = "host: "


def host_reason(reason: str) -> str:
    return reason if reason.startswith(HOST) else HOST + reason


def host_skip(reason: str) -> NoReturn:
    pytest.skip(host_reason(reason))


def is_host_skip(reason: str) -> bool:
    return reason.removeprefix("Skipped: ").startswith(HOST)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped report (pytest keeps it as (path, line, reason))."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def sandbox_unavailable() -> str | None:
    """Why the sandbox engine cannot run here, as a skip reason, or None. Not being root and a
    kernel without usable cgroup controllers are host skips; a missing bubblewrap is not
    (scripts/install_sandbox_deps.sh installs it)."""
    if os.geteuid() != 0:
        return host_reason("the sandbox engine runs as root (cgroups, dropping to the sandbox "
                           "uid)")
    if not shutil.which("bwrap"):
        return "bubblewrap missing: run scripts/install_sandbox_deps.sh (apt: bubblewrap)"
    from workers.sandbox import cgroups

    try:
        cgroups.backend()
    except cgroups.CgroupError as exc:
        return host_reason(str(exc))
    return None


# -- the plugin: under CI=true a skip that is not a host skip fails ------------------------------

def _missing(reason: str) -> str:
    return (f"CI=true: skipped for a missing dependency that `make test` installs: {reason} "
            "(a skip that no install can fix says so with tests.skips.host_reason)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = skip_reason(report.longrepr)
        if not is_host_skip(reason):
            report.outcome = "failed"
            report.longrepr = _missing(reason)


_SKIPPED_MODULES = pytest.StashKey[list[str]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (``pytest.importorskip`` at its top) is noted here and
    fails the session at its end (a collection error would stop the other tests running)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci():
        reason = skip_reason(report.longrepr)
        if not is_host_skip(reason):
            collector.config.stash.setdefault(_SKIPPED_MODULES, []).append(
                f"{report.nodeid}: {_missing(reason)}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_SKIPPED_MODULES, [])
    if lines:
        terminalreporter.section("modules skipped for a missing dependency (CI=true)", red=True)
        for line in lines:
            terminalreporter.write_line(f"FAILED (module skipped) {line}", red=True)


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash.get(_SKIPPED_MODULES, []) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
