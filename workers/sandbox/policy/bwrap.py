"""The bubblewrap command line: which namespaces, which mounts, which environment.

The sandbox sees a read-only /usr (with the merged-/usr symlinks), a handful of /etc files the
toolchains need (not /etc itself: host configuration is none of the program's business), a fresh
/proc for its own PID namespace, a minimal /dev, a size-capped tmpfs /tmp and one writable
directory, /work. `--remount-ro /` must come after every other mount or it is undone by them.

The /etc entries reach the sandbox as one read-only bind of a root-owned copy of them (see
etc_snapshot), not one bind each: bwrap re-reads the whole mount table for every bind it makes,
and six /etc binds cost about 0.5 ms of CPU per sandbox, about 4% of an isolated execution.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import itertools
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

# The bubblewrap binary; another path where a host installs it elsewhere.
BWRAP = os.environ.get("CRUCIBLE_SANDBOX_BWRAP", "").strip() or "/usr/bin/bwrap"
WORK = "/work"
PATH = "/usr/local/bin:/usr/bin:/bin"

_ETC_FILES = (
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
    "/etc/localtime", "/etc/java-*-openjdk",
)


def etc_binds() -> list[str]:
    """Existing /etc entries the toolchains read (alternatives symlinks, the loader cache, JDK)."""
    found: list[str] = []
    for pattern in _ETC_FILES:
        found.extend(sorted(glob.glob(pattern)))
    return found


ETC_SNAPSHOTS = Path(os.environ.get("CRUCIBLE_SANDBOX_ETC_DIR", "/run/crucible-sandbox"))
"""Root-owned folder holding each engine process's copy of the /etc entries (etc-<pid>-<n>)."""
_SNAPSHOT_CHECK_S = 10.0
_snapshot_lock = threading.Lock()
_snapshot: tuple[object, Path] | None = None  # (pid, entries and signature), the copy
_snapshot_checked = 0.0
_snapshot_counter = itertools.count()


def _signature(paths: list[str]) -> tuple[object, ...]:
    """What changes when an entry is replaced or edited (apt, update-alternatives, ldconfig
    write a new file and rename it, which changes the inode or the directory's mtime)."""
    sig: list[object] = []
    for path in paths:
        for look in (os.lstat, os.stat):
            try:
                st = look(path)
                sig.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append(None)
    return tuple(sig)


def _root_only(path: Path) -> bool:
    st = os.lstat(path)
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == 0
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _remove_stale_snapshots() -> None:
    """Copies left by engine processes that are gone."""
    for old in ETC_SNAPSHOTS.glob("etc-*-*"):
        owner = old.name.split("-")[1]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(old, ignore_errors=True)


def _copy_etc(paths: list[str]) -> Path:
    """A fresh root-owned, world-readable copy of `paths` (symlinks kept as links: they point
    into /usr, which the sandbox has), laid out as /etc is."""
    ETC_SNAPSHOTS.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not _root_only(ETC_SNAPSHOTS):
        raise PermissionError(f"{ETC_SNAPSHOTS} is not a root-owned folder only root writes")
    _remove_stale_snapshots()
    name = f"etc-{os.getpid()}-{next(_snapshot_counter)}"
    tmp = ETC_SNAPSHOTS / f".{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    try:
        for path in paths:
            if not path.startswith("/etc/") or ".." in path.split("/"):
                raise ValueError(f"{path} is not an entry of /etc")
            dest = tmp / path.removeprefix("/etc/")
            dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            if os.path.islink(path):
                os.symlink(os.readlink(path), dest)
            elif os.path.isdir(path):
                shutil.copytree(path, dest, symlinks=True)
            else:
                shutil.copy2(path, dest)
        os.chmod(tmp, 0o755)
        final = ETC_SNAPSHOTS / name
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def etc_snapshot() -> Path | None:
    """The current copy of the /etc entries the toolchains read, refreshed (as a new folder:
    sandboxes being set up may still bind the old one) when one of them changed; checked every
    10 s. None where no copy can be made (not root, read-only /run): then each entry is bound
    on its own."""
    global _snapshot, _snapshot_checked
    now = time.monotonic()
    with _snapshot_lock:
        if _snapshot is not None and now - _snapshot_checked < _SNAPSHOT_CHECK_S:
            return _snapshot[1]
        _snapshot_checked = now
        paths = etc_binds()
        # the pid: a forked child makes its own (its parent's is removed when the parent goes)
        sig = (os.getpid(), tuple(paths), _signature(paths))
        if _snapshot is None or _snapshot[0] != sig:
            try:
                _snapshot = (sig, _copy_etc(paths))
            except (OSError, ValueError):
                return None
        return _snapshot[1]


@atexit.register
def _remove_own_snapshots() -> None:
    with contextlib.suppress(OSError):
        for own in ETC_SNAPSHOTS.glob(f"etc-{os.getpid()}-*"):
            shutil.rmtree(own, ignore_errors=True)


def _static_prefix() -> tuple[str, ...]:
    """The part of every command line that depends on nothing but the host: namespaces and the
    read-only system mounts (with the /etc copy of the moment)."""
    snapshot = etc_snapshot()
    if snapshot is not None:
        return (*_system_prefix(), "--ro-bind", str(snapshot), "/etc")
    return (*_system_prefix(), *itertools.chain.from_iterable(
        ("--ro-bind", path, path) for path in etc_binds()))


@functools.lru_cache(maxsize=1)
def _system_prefix() -> tuple[str, ...]:
    """Namespaces, /usr and its merged-/usr symlinks. Built once per process (globbing /etc
    for each sandbox cost more supervisor CPU than the rest of the command line); toolchains
    installed later appear after a restart of the engine's process."""
    args = [
        BWRAP,
        "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try", "--disable-userns",
        "--uid", "1000", "--gid", "1000", "--hostname", "sandbox",
        "--die-with-parent", "--new-session", "--clearenv",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
        "--symlink", "usr/lib", "/lib",
    ]
    if os.path.isdir("/usr/lib64"):
        args += ["--symlink", "usr/lib64", "/lib64"]
    return tuple(args)


def command(
    *,
    workdir: Path,
    argv: Sequence[str],
    env: dict[str, str],
    seccomp_fd: int,
    tmpfs_bytes: int,
    ro_binds: Iterable[tuple[str, str]] = (),
    as_pid_1: bool = False,
) -> list[str]:
    """The full bwrap argv running `argv` in a fresh sandbox rooted on `workdir`.

    `as_pid_1` runs argv itself as the PID namespace's init instead of under bwrap's reaper:
    for a program's parent that reports its wait status (pid 1 also cannot be signalled from
    inside the namespace, so the program cannot kill its reporter), and one process fewer."""
    args = list(_static_prefix())
    for host, inside in ro_binds:
        args += ["--ro-bind", host, inside]
    args += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--bind", str(workdir), WORK, "--chdir", WORK,
    ]
    for key, value in {"PATH": PATH, "HOME": "/tmp", "LANG": "C.UTF-8", **env}.items():
        args += ["--setenv", key, value]
    if as_pid_1:
        args.append("--as-pid-1")
    args += ["--seccomp", str(seccomp_fd), "--remount-ro", "/", "--", *argv]
    return args
