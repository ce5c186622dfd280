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
import select
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
GROUP = "crucible-sandbox"

_counter = itertools.count()


class CgroupError(RuntimeError):
    """The host's cgroups cannot give an execution the limits it needs."""


def _write(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path | str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _int(path: Path | str) -> int:
    text = _read(path).strip()
    return int(text) if text.isdigit() else 0


def parse_keyed(text: str) -> dict[str, int]:
    """`key value` lines (cpu.stat, memory.events, memory.oom_control) as a dict."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            found[parts[0]] = int(parts[1])
    return found


def _keyed(path: Path | str, key: str) -> int:
    return parse_keyed(_read(path)).get(key, 0)


def v2_limit_files(memory_bytes: int, pids: int) -> list[tuple[str, str, bool]]:
    """(file, value, required) writes that give a v2 cgroup its limits: RAM without swap, the
    whole group OOM-killed together (an MLE ends the run rather than one thread of it), and a
    process cap. memory.swap.max is absent where swap accounting is off (then there is no swap
    to limit) and memory.oom.group before kernel 4.19, so those two are optional."""
    return [
        ("memory.max", str(memory_bytes), True),
        ("memory.swap.max", "0", False),
        ("memory.oom.group", "1", False),
        ("pids.max", str(pids), True),
    ]


def oom_killed(events: dict[str, int]) -> bool:
    """Whether memory.events (v2) or memory.oom_control (v1) records an OOM kill."""
    return events.get("oom_kill", 0) > 0 or events.get("oom_group_kill", 0) > 0


def _rmdir(path: Path, on_busy: Callable[[], object] | None = None) -> None:
    """Remove a cgroup directory; `on_busy` runs at the first EBUSY (e.g. reaping zombies that
    still count as members on v1) before the retries."""
    for attempt in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            if attempt == 0 and on_busy is not None:
                on_busy()
                continue
            time.sleep(0.002)  # exiting tasks leave the cgroup asynchronously


def wait_exited(pids: set[int], timeout: float) -> None:
    """Wait up to `timeout` until every one of `pids` has exited (a pidfd turns readable when
    its process is dead), instead of re-reading the cgroup's process list every millisecond:
    on v1 each read of cgroup.procs builds (and later frees on a kworker) a pid list."""
    fds: list[int] = []
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            fds.append(os.pidfd_open(pid))
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        pending = len(fds)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                pending -= 1
    finally:
        for fd in fds:
            os.close(fd)


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

    def pids_max_hits(self) -> int:
        """How often a fork was refused at pids.max (pids.events `max`); 0 where unknown."""
        with contextlib.suppress(OSError):
            return _keyed(self._pids_events(), "max")
        return 0

    def _pids_events(self) -> Path:
        raise OSError("no pids.events")

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
        """SIGKILL everything in the cgroup until it is empty (forks racing the kill too),
        waiting for each round's processes to exit before looking again (for about 2 s at
        most). Returns every pid it saw, so the caller can reap the ones re-parented to it."""
        seen: set[int] = set()
        deadline = time.monotonic() + 2.0
        while True:
            pids = self.signal_all()
            left = deadline - time.monotonic()
            if not pids or left <= 0:
                break
            seen |= pids
            wait_exited(pids, min(left, 0.05))
        return seen

    @abstractmethod
    def remove(self, on_busy: Callable[[], object] | None = None) -> None:
        """Remove the (empty) cgroup; `on_busy` runs if the kernel still finds it busy."""


class CgroupV1(Cgroup):
    version = 1
    CONTROLLERS = ("memory", "pids", "cpuacct")

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dirs = {c: ROOT / c / GROUP / name for c in self.CONTROLLERS}
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=False)
        # Plain strings: these files are opened several times per execution.
        mem, pids, cpu = (str(self.dirs[c]) for c in self.CONTROLLERS)
        self._procs = (f"{mem}/cgroup.procs", f"{pids}/cgroup.procs", f"{cpu}/cgroup.procs")
        self._mem = mem
        self._pids_max = f"{pids}/pids.max"
        self._usage = f"{cpu}/cpuacct.usage"
        self._has_memsw = os.path.exists(f"{mem}/memory.memsw.limit_in_bytes")
        self._limits: tuple[int, int] | None = None
        self._fds: dict[str, int] = {}

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        if self._limits == (memory_bytes, pids):
            return  # a warm sandbox whose request asks for the limits it was started with
        mem = self._mem
        # memsw must stay >= the RAM limit: if one order is refused, the other one works.
        order = [("memory.limit_in_bytes", memory_bytes)]
        if self._has_memsw:
            order.append(("memory.memsw.limit_in_bytes", memory_bytes))
        try:
            for file, value in order:
                _write(f"{mem}/{file}", str(value))
        except OSError:
            for file, value in reversed(order):
                _write(f"{mem}/{file}", str(value))
        if self._limits is None:
            with contextlib.suppress(OSError):
                _write(f"{mem}/memory.swappiness", "0")
        _write(self._pids_max, str(pids))
        self._limits = (memory_bytes, pids)

    def add(self, pid: int) -> None:
        for path in self._procs:
            _write(path, str(pid))

    def _pread(self, path: str) -> str:
        """Read a counter polled several times per execution through an fd kept open (each
        read at offset 0 of cpuacct.usage reports the current value)."""
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                return ""
            self._fds[path] = fd
        return os.pread(fd, 1 << 16, 0).decode()

    def procs(self) -> list[int]:
        # Every process is added to all three hierarchies and its children inherit them, so the
        # pids hierarchy lists them all. Opened afresh each time: v1 caches the pid list of an
        # open cgroup.procs file for a second, so re-reading a kept fd shows the dead.
        return sorted({int(p) for p in _read(self._procs[1]).split()})

    def cpu_ns(self) -> int:
        text = self._pread(self._usage).strip()
        return int(text) if text.isdigit() else 0

    def peak_memory(self) -> int:
        return _int(f"{self._mem}/memory.max_usage_in_bytes")

    def reset_peak(self) -> None:  # noqa: B027 - optional: a no-op where the kernel has no reset
        with contextlib.suppress(OSError):
            _write(f"{self._mem}/memory.max_usage_in_bytes", "0")

    def oom_kills(self) -> int:
        return _keyed(f"{self._mem}/memory.oom_control", "oom_kill")

    def _pids_events(self) -> Path:
        return self.dirs["pids"] / "pids.events"

    def remove(self, on_busy: Callable[[], object] | None = None) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for path in self.dirs.values():
            _rmdir(path, on_busy)


class CgroupV2(Cgroup):
    """A cgroup in the unified hierarchy, under `parent` (v2_parent() unless given).

    `create=False` attaches to an existing directory (one the kernel, or a test laying out a
    cgroup2 tree in a temporary directory, has populated with its control files)."""

    version = 2

    def __init__(self, name: str, parent: Path | None = None, *, create: bool = True) -> None:
        super().__init__(name)
        self.dir = (parent if parent is not None else v2_parent()) / name
        self._peak_fd: int | None = None
        if create:
            self.dir.mkdir(exist_ok=False)

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        for file, value, required in v2_limit_files(memory_bytes, pids):
            try:
                _write(self.dir / file, value)
            except FileNotFoundError:
                if required:
                    raise CgroupError(f"{self.dir / file} is missing: the memory and pids "
                                      "controllers are not enabled for this cgroup") from None

    def add(self, pid: int) -> None:
        _write(self.dir / "cgroup.procs", str(pid))

    def procs(self) -> list[int]:
        return sorted(int(p) for p in _read(self.dir / "cgroup.procs").split())

    def cpu_ns(self) -> int:
        return _keyed(self.dir / "cpu.stat", "usage_usec") * 1000

    def reset_peak(self) -> None:
        """Kernels >= 6.12 reset memory.peak per open file: writing to an fd makes reads of that
        same fd report the peak since the write. Older kernels refuse the write (read-only file);
        the peak then includes the warm interpreter's start-up."""
        self._close_peak()
        try:
            fd = os.open(self.dir / "memory.peak", os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            os.write(fd, b"reset\n")
        except OSError:
            os.close(fd)
            return
        self._peak_fd = fd

    def _close_peak(self) -> None:
        if self._peak_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._peak_fd)
            self._peak_fd = None

    def peak_memory(self) -> int:
        if self._peak_fd is not None:
            with contextlib.suppress(OSError, ValueError):
                return int(os.pread(self._peak_fd, 64, 0).decode().strip() or 0)
        peak = _int(self.dir / "memory.peak")  # kernels >= 5.19
        return peak or _int(self.dir / "memory.current")

    def oom_kills(self) -> int:
        events = parse_keyed(_read(self.dir / "memory.events"))
        return events.get("oom_kill", 0) + events.get("oom_group_kill", 0)

    def _pids_events(self) -> Path:
        return self.dir / "pids.events"

    def populated(self) -> bool:
        """cgroup.events says whether any process is left in the group (or its children)."""
        return parse_keyed(_read(self.dir / "cgroup.events")).get("populated", 0) != 0

    def kill(self) -> set[int]:
        """cgroup.kill (kernels >= 5.14) SIGKILLs every process of the group at once, forks in
        flight included; the signal loop of the base class covers older kernels."""
        seen = set(self.procs())
        kill_file = self.dir / "cgroup.kill"
        if kill_file.exists():
            _write(kill_file, "1")
            for _ in range(500):
                if not self.populated():
                    break
                time.sleep(0.001)
        return seen | super().kill()

    def remove(self, on_busy: Callable[[], object] | None = None) -> None:
        self._close_peak()
        _rmdir(self.dir, on_busy)


def v1_available() -> bool:
    return all(
        os.access(ROOT / c, os.W_OK) and (ROOT / c / "cgroup.procs").exists()
        for c in CgroupV1.CONTROLLERS
    ) and (ROOT / "memory" / "memory.limit_in_bytes").exists()


def v2_mount(root: Path | None = None) -> Path:
    """Where the unified hierarchy is mounted: /sys/fs/cgroup itself, or the hybrid layout's
    /sys/fs/cgroup/unified."""
    base = root if root is not None else ROOT
    return base if (base / "cgroup.controllers").exists() else base / "unified"


def v2_parent(root: Path | None = None) -> Path:
    """The v2 directory holding execution cgroups, with memory, pids (and cpu when offered)
    enabled for its children. Controllers must be enabled top-down: first in the mount's own
    cgroup.subtree_control, then in the parent's."""
    mount = v2_mount(root)
    parent = mount / GROUP
    wanted = {"memory", "pids", "cpu"}
    enabled = set(_read(parent / "cgroup.subtree_control").split())
    if wanted <= enabled:
        return parent
    available = set(_read(mount / "cgroup.controllers").split())
    if not {"memory", "pids"} <= available:
        raise CgroupError(f"cgroup v2 at {mount} lacks the memory and pids controllers "
                          f"(it offers: {' '.join(sorted(available)) or 'none'})")
    if not parent.exists():
        parent.mkdir()
    enable = " ".join(f"+{c}" for c in sorted(wanted & available))
    if not {"memory", "pids"} <= set(_read(mount / "cgroup.subtree_control").split()):
        _write(mount / "cgroup.subtree_control", enable)
    _write(parent / "cgroup.subtree_control", enable)
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
