"""The start-up gate's executable (`harness/gate.c`): where it lives, building it, trusting it.

The gate runs as root on the host for every execution, so only a root-owned file in a
root-owned directory that nobody else can write is used. It is built with the host's gcc,
static and without libc (x86-64 only), into `CRUCIBLE_SANDBOX_GATE_DIR` (default
`/usr/local/lib/crucible-sandbox`) under a name carrying the source's hash, so a changed source is
rebuilt rather than an old binary trusted. `scripts/install_sandbox_deps.sh` builds it; the
engine builds it on first use when it is missing. Where it cannot be built (no compiler, not
root), `gate_binary()` is None and the engine falls back to the dash + setpriv gate.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import subprocess
import threading
from pathlib import Path

from .harness import source

GATE_DIR = Path(os.environ.get("CRUCIBLE_SANDBOX_GATE_DIR", "/usr/local/lib/crucible-sandbox"))
CC = "/usr/bin/gcc"
CFLAGS = ("-O2", "-s", "-Wall", "-static", "-nostdlib", "-ffreestanding", "-fno-builtin",
          "-fno-stack-protector", "-fno-tree-loop-distribute-patterns", "-fno-pie", "-no-pie")
"""No libc: its start-up alone cost three times the rest of the gate (see gate.c). The same
flags are in scripts/install_sandbox_deps.sh."""

_lock = threading.Lock()
_resolved = False
_binary: str | None = None


def binary_path(directory: Path | None = None) -> Path:
    """Where the gate built from the current source lives."""
    digest = hashlib.sha256(source("gate.c").encode()).hexdigest()[:16]
    return (directory or GATE_DIR) / f"gate-{digest}"


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


def build(directory: Path | None = None) -> Path:
    """Compile the gate into `directory` (root only) and return its path; raises OSError or
    CalledProcessError when that is impossible."""
    target = binary_path(directory)
    if trusted(target):
        return target
    if os.geteuid() != 0:
        raise PermissionError("only root builds the sandbox gate")
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not _dir_trusted(target.parent):
        raise PermissionError(f"{target.parent} is not a root-owned directory only root writes")
    tmp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        subprocess.run([CC, *CFLAGS, "-x", "c", "-", "-o", str(tmp)],
                       input=source("gate.c").encode(), check=True, capture_output=True,
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


def gate_binary() -> str | None:
    """The trusted gate executable, built on first use if needed; None where it cannot be
    (the caller then uses the shell + setpriv gate). Resolved once per process."""
    global _resolved, _binary
    with _lock:
        if not _resolved:
            path = binary_path()
            if not trusted(path) and os.access(CC, os.X_OK):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    path = build()
            _binary = str(path) if trusted(path) else None
            _resolved = True
        return _binary
