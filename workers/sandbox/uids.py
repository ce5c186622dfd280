"""One host uid (and gid) per concurrent sandbox, from a dedicated range.

The kernel keeps several limits per user, not per process or namespace: inotify instances and
watches, POSIX message queue bytes, RLIMIT_NPROC, pending signals, user namespaces. With every
sandbox running as one uid, one sandbox that took all 128 inotify instances made every
concurrent sandbox (and any host process of that uid) fail with EMFILE. Each sandbox therefore
runs as a uid of its own, taken from `CRUCIBLE_SANDBOX_UIDS` (`first:count`, default
`1200000000:65536`: far above Debian's login uids and its subordinate ranges, which start at
100000 and grow by 65536 per user), and given back only once every process of it is gone.

Several supervisor processes on one host (Celery workers, test runs) share the range without
talking to each other: each claims blocks of `BLOCK` uids by holding an exclusive `flock` on a
per-block file under a root-only folder, which the kernel releases when the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from pathlib import Path

BLOCK = 64
LOCK_DIR = Path(os.environ.get("CRUCIBLE_SANDBOX_UID_LOCKS", "/run/crucible-sandbox/uids"))


class UidsExhausted(RuntimeError):
    """Every uid of the range is in use by a sandbox of some process on this host."""


def _range() -> tuple[int, int]:
    spec = os.environ.get("CRUCIBLE_SANDBOX_UIDS", "1200000000:65536")
    try:
        first_text, count_text = spec.split(":")
        first, count = int(first_text), int(count_text)
    except ValueError as exc:
        raise ValueError(f"CRUCIBLE_SANDBOX_UIDS={spec!r}: expected first:count") from exc
    if first < 1000 or count < BLOCK or first + count > 0xFFFFFFFE:
        raise ValueError(f"CRUCIBLE_SANDBOX_UIDS={spec!r}: the range must lie in "
                         f"1000..4294967294 and hold at least {BLOCK} uids")
    return first, count


class UidPool:
    """Hands out uids of the range to this process's sandboxes; thread-safe."""

    def __init__(self) -> None:
        self.first, self.count = _range()
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._blocks: dict[int, int] = {}  # block number -> fd holding its flock
        self._pid = os.getpid()

    def _claim_block(self) -> None:
        LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(LOCK_DIR)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{LOCK_DIR} must be a folder only this user can write")
        for block in range(self.count // BLOCK):
            if block in self._blocks:
                continue
            fd = os.open(LOCK_DIR / f"{self.first + block * BLOCK}.lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._blocks[block] = fd
            start = self.first + block * BLOCK
            self._free.extend(range(start + BLOCK - 1, start - 1, -1))
            return
        raise UidsExhausted(f"all {self.count} sandbox uids from {self.first} are in use on "
                            "this host; widen CRUCIBLE_SANDBOX_UIDS")

    def lease(self) -> int:
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: its parent's flocks are not ours
                self._blocks.clear()
                self._free.clear()
                self._pid = os.getpid()
            if not self._free:
                self._claim_block()
            return self._free.pop()

    def release(self, uid: int) -> None:
        """Give a uid back; only once no process runs as it any more."""
        with self._lock:
            block = (uid - self.first) // BLOCK
            if block in self._blocks and uid not in self._free:
                self._free.append(uid)

    def in_use(self) -> int:
        with self._lock:
            return len(self._blocks) * BLOCK - len(self._free)

    def close(self) -> None:
        with self._lock:
            for fd in self._blocks.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._blocks.clear()
            self._free.clear()


_pool: UidPool | None = None
_pool_lock = threading.Lock()


def pool() -> UidPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = UidPool()
        return _pool


def lease() -> int:
    """A uid no other live sandbox on this host runs as."""
    return pool().lease()


def release(uid: int) -> None:
    pool().release(uid)
