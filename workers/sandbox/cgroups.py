"""One cgroup per execution: memory without swap, a process cap, CPU accounting, and teardown.

Two backends behind one interface, because hosts differ: cgroup v1 (separate memory, pids and
cpuacct hierarchies, as on this project's Firecracker VMs) and the unified cgroup v2. Killing the
cgroup, not a process, is what guarantees that double-forked daemons die with the execution.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
GROUP = "crucible-sandbox"

_counter = itertools.count()


class CgroupError(RuntimeError):
    """The host's cgroups cannot give an execution the limits it needs."""


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _int(path: Path) -> int:
    text = _read(path).strip()
    return int(text) if text.isdigit() else 0


def _keyed(path: Path, key: str) -> int:
    for line in _read(path).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _rmdir(path: Path) -> None:
    for _ in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.002)  # exiting tasks leave the cgroup asynchronously


class Cgroup(ABC):
    """A per-execution cgroup; subclasses map the operations onto v1 or v2 files."""

    version: int = 0

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def set_limits(self, *, memory_bytes: int, pids: int) -> None: ...

    @abstractmethod
    def add(self, pid: int) -> None: ...

    @abstractmethod
    def procs(self) -> list[int]: ...

    @abstractmethod
    def cpu_ns(self) -> int: ...

    @abstractmethod
    def peak_memory(self) -> int: ...

    def reset_peak(self) -> None:  # noqa: B027 - optional: a no-op where the kernel has no reset
        """Forget the peak so far (a warm sandbox's interpreter start-up is not the program's)."""

    @abstractmethod
    def oom_kills(self) -> int: ...

    def signal_all(self) -> set[int]:
        """SIGKILL everything in the cgroup once, without waiting: none of it runs code again,
        and a fork racing the signal is caught by kill() at teardown (or dies with its PID
        namespace, whose init was just killed). Returns the pids it signalled."""
        pids = set(self.procs())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def kill(self) -> set[int]:
        """SIGKILL everything in the cgroup until it is empty (forks racing the kill too).
        Returns every pid it saw, so the caller can reap the ones re-parented to it."""
        seen: set[int] = set()
        for _ in range(2000):
            pids = self.signal_all()
            if not pids:
                break
            seen |= pids
            time.sleep(0.001)
        return seen

    @abstractmethod
    def remove(self) -> None: ...


class CgroupV1(Cgroup):
    version = 1
    CONTROLLERS = ("memory", "pids", "cpuacct")

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dirs = {c: ROOT / c / GROUP / name for c in self.CONTROLLERS}
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=False)

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        mem = self.dirs["memory"]
        memsw = mem / "memory.memsw.limit_in_bytes"
        # memsw must stay >= the RAM limit: if one order is refused, the other one works.
        order = [("memory.limit_in_bytes", memory_bytes)]
        if memsw.exists():
            order.append(("memory.memsw.limit_in_bytes", memory_bytes))
        try:
            for file, value in order:
                _write(mem / file, str(value))
        except OSError:
            for file, value in reversed(order):
                _write(mem / file, str(value))
        with contextlib.suppress(OSError):
            _write(mem / "memory.swappiness", "0")
        _write(self.dirs["pids"] / "pids.max", str(pids))

    def add(self, pid: int) -> None:
        for path in self.dirs.values():
            _write(path / "cgroup.procs", str(pid))

    def procs(self) -> list[int]:
        text = " ".join(_read(self.dirs[c] / "cgroup.procs") for c in ("pids", "memory"))
        return sorted({int(p) for p in text.split()})

    def cpu_ns(self) -> int:
        return _int(self.dirs["cpuacct"] / "cpuacct.usage")

    def peak_memory(self) -> int:
        return _int(self.dirs["memory"] / "memory.max_usage_in_bytes")

    def reset_peak(self) -> None:  # noqa: B027 - optional: a no-op where the kernel has no reset
        with contextlib.suppress(OSError):
            _write(self.dirs["memory"] / "memory.max_usage_in_bytes", "0")

    def oom_kills(self) -> int:
        return _keyed(self.dirs["memory"] / "memory.oom_control", "oom_kill")

    def remove(self) -> None:
        for path in self.dirs.values():
            _rmdir(path)


class CgroupV2(Cgroup):
    version = 2

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dir = v2_parent() / name
        self.dir.mkdir(exist_ok=False)

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        _write(self.dir / "memory.max", str(memory_bytes))
        with contextlib.suppress(FileNotFoundError):
            _write(self.dir / "memory.swap.max", "0")
        _write(self.dir / "pids.max", str(pids))

    def add(self, pid: int) -> None:
        _write(self.dir / "cgroup.procs", str(pid))

    def procs(self) -> list[int]:
        return sorted(int(p) for p in _read(self.dir / "cgroup.procs").split())

    def cpu_ns(self) -> int:
        return _keyed(self.dir / "cpu.stat", "usage_usec") * 1000

    def peak_memory(self) -> int:
        return _int(self.dir / "memory.peak")

    def oom_kills(self) -> int:
        return _keyed(self.dir / "memory.events", "oom_kill")

    def kill(self) -> set[int]:
        seen = set(self.procs())
        kill_file = self.dir / "cgroup.kill"
        if kill_file.exists():
            _write(kill_file, "1")
        return seen | super().kill()

    def remove(self) -> None:
        _rmdir(self.dir)


def v1_available() -> bool:
    return all(
        os.access(ROOT / c, os.W_OK) and (ROOT / c / "cgroup.procs").exists()
        for c in CgroupV1.CONTROLLERS
    ) and (ROOT / "memory" / "memory.limit_in_bytes").exists()


def v2_parent() -> Path:
    """The v2 directory holding execution cgroups, with memory and pids delegated to it."""
    mount = ROOT if (ROOT / "cgroup.controllers").exists() else ROOT / "unified"
    parent = mount / GROUP
    if not parent.exists():
        parent.mkdir()
    wanted = {"memory", "pids", "cpu"}
    if not wanted <= set(_read(parent / "cgroup.subtree_control").split()):
        available = set(_read(mount / "cgroup.controllers").split())
        if not {"memory", "pids"} <= available:
            raise CgroupError(f"cgroup v2 at {mount} lacks the memory and pids controllers")
        with contextlib.suppress(OSError):
            _write(mount / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted & available))
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted & available))
    return parent


def v2_available() -> bool:
    try:
        v2_parent()
    except (OSError, CgroupError):
        return False
    return True


_backend: type[Cgroup] | None = None


def remove_stale() -> int:
    """Remove empty execution cgroups left by supervisors that died (named <pid>-...)."""
    removed = 0
    parents = [ROOT / c / GROUP for c in CgroupV1.CONTROLLERS] if _backend is CgroupV1 else (
        [v2_parent()] if _backend is CgroupV2 else [])
    for parent in parents:
        for child in parent.glob("*-*-*"):
            owner = child.name.split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    child.rmdir()
                    removed += 1
    return removed


def backend() -> type[Cgroup]:
    """The cgroup flavour this host supports (v1 preferred where its controllers are mounted)."""
    global _backend
    if _backend is None:
        if v1_available():
            _backend = CgroupV1
        elif v2_available():
            _backend = CgroupV2
        else:
            raise CgroupError(
                "no writable cgroup with memory and pids controllers: run the sandbox as root "
                "on a host with cgroup v1 memory/pids/cpuacct or cgroup v2 memory/pids"
            )
        remove_stale()
    return _backend


def create(*, memory_bytes: int, pids: int) -> Cgroup:
    """A fresh cgroup with limits set; the caller must kill() and remove() it."""
    cls = backend()
    group = cls(f"{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}")
    try:
        group.set_limits(memory_bytes=memory_bytes, pids=pids)
    except BaseException:
        group.remove()
        raise
    return group
