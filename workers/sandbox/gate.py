"""The sandbox's static helpers (`harness/gate.c`, `harness/waiter.c`): where they live, building
them, trusting them.

The gate runs as root on the host for every execution, and the waiter is PID 1 of every sandbox,
so only a root-owned file in a root-owned directory that nobody else can write is used. They are
built with the host's gcc, static and without libc (x86-64 only, `harness/nolibc.h`), into
`CRUCIBLE_SANDBOX_GATE_DIR` (default `/usr/local/lib/crucible-sandbox`) under a name carrying the
hash of their sources, so a changed source is rebuilt rather than an old binary trusted.
`scripts/install_sandbox_deps.sh` builds them; the engine builds them on first use when missing.
Where one cannot be built (no compiler, not root, another architecture) its resolver returns
None and the engine falls back: dash + setpriv for the gate, the Perl waiter for the waiter.

The default directory lies under /usr, which every sandbox has read-only, so the waiter runs
inside the sandbox from the same path; elsewhere it is bound in (`waiter_mount`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import subprocess
import threading
from pathlib import Path

from .harness import _HERE as HARNESS_DIR
from .harness import source

GATE_DIR = Path(os.environ.get("CRUCIBLE_SANDBOX_GATE_DIR", "/usr/local/lib/crucible-sandbox"))
CC = "/usr/bin/gcc"
CFLAGS = ("-O2", "-s", "-Wall", "-static", "-nostdlib", "-ffreestanding", "-fno-builtin",
          "-fno-stack-protector", "-fno-tree-loop-distribute-patterns", "-fno-pie", "-no-pie")
"""No libc: its start-up alone cost three times the rest of the gate (see nolibc.h)."""
TOOLS = ("gate", "waiter")
WAITER_INSIDE = "/.crucible-waiter"
"""Where the waiter is bound in a sandbox when GATE_DIR lies outside /usr."""

_lock = threading.Lock()
_resolved: dict[str, str | None] = {}


def _sources(tool: str) -> bytes:
    return (source("nolibc.h") + source(f"{tool}.c")).encode()


def binary_path(tool: str = "gate", directory: Path | None = None) -> Path:
    """Where the helper built from the current sources lives."""
    digest = hashlib.sha256(_sources(tool)).hexdigest()[:16]
    return (directory or GATE_DIR) / f"{tool}-{digest}"


def trusted(path: Path) -> bool:
    """A regular file (not a link) owned by root and writable by nobody else, in a directory
    that is too: anyone able to replace it would run code as root."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == 0
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            and bool(st.st_mode & stat.S_IXUSR) and _dir_trusted(path.parent))


def build(tool: str = "gate", directory: Path | None = None) -> Path:
    """Compile the helper into `directory` (root only) and return its path; raises OSError or
    CalledProcessError when that is impossible."""
    if tool not in TOOLS:
        raise ValueError(f"unknown sandbox helper {tool!r}; known: {', '.join(TOOLS)}")
    target = binary_path(tool, directory)
    if trusted(target):
        return target
    if os.geteuid() != 0:
        raise PermissionError("only root builds the sandbox helpers")
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not _dir_trusted(target.parent):
        raise PermissionError(f"{target.parent} is not a root-owned directory only root writes")
    tmp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        subprocess.run([CC, *CFLAGS, "-I", str(HARNESS_DIR), "-x", "c", "-", "-o", str(tmp)],
                       input=source(f"{tool}.c").encode(), check=True, capture_output=True,
                       timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if not trusted(target):
        raise PermissionError(f"{target} was built but is not trusted")
    return target


def _dir_trusted(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == 0
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def tool_binary(tool: str) -> str | None:
    """The trusted helper, built on first use if needed; None where it cannot be (the caller
    then uses its fallback). Resolved once per process."""
    with _lock:
        if tool not in _resolved:
            path = binary_path(tool)
            if not trusted(path) and os.access(CC, os.X_OK):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    path = build(tool)
            _resolved[tool] = str(path) if trusted(path) else None
        return _resolved[tool]


def gate_binary() -> str | None:
    """The start-up gate, or None (then dash + setpriv)."""
    return tool_binary("gate")


def waiter_binary() -> str | None:
    """The status waiter, or None (then the Perl waiter)."""
    return tool_binary("waiter")


def waiter_mount() -> tuple[str, str] | None:
    """(host, sandbox) bind that makes the waiter runnable inside, or None where /usr already
    holds it; the sandbox path to run it by is waiter_inside()."""
    binary = waiter_binary()
    if binary is None or binary.startswith("/usr/"):
        return None
    return binary, WAITER_INSIDE


def waiter_inside() -> str | None:
    binary = waiter_binary()
    if binary is None:
        return None
    return binary if binary.startswith("/usr/") else WAITER_INSIDE


if __name__ == "__main__":  # scripts/install_sandbox_deps.sh: build both, say where
    for name in TOOLS:
        try:
            print(f"install_sandbox_deps: sandbox {name} {build(name)}")
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"install_sandbox_deps: could not build the sandbox {name} ({exc}); the "
                  "engine uses its fallback")
