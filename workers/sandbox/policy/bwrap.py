"""The bubblewrap command line: which namespaces, which mounts, which environment.

The sandbox sees a read-only /usr (with the merged-/usr symlinks), a handful of /etc files the
toolchains need (not /etc itself: host configuration is none of the program's business), a fresh
/proc for its own PID namespace, a minimal /dev, a size-capped tmpfs /tmp and one writable
directory, /work. `--remount-ro /` must come after every other mount or it is undone by them.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

BWRAP = "/usr/bin/bwrap"
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


@functools.lru_cache(maxsize=1)
def _static_prefix() -> tuple[str, ...]:
    """The part of every command line that depends on nothing but the host: namespaces and the
    read-only system mounts. Built once per process (globbing /etc for each sandbox cost more
    supervisor CPU than the rest of the command line); toolchains installed later appear after a
    restart of the engine's process."""
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
    for path in etc_binds():
        args += ["--ro-bind", path, path]
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
