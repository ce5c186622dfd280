"""Warm pool: pre-started, single-use sandboxes for interpreted languages.

Interpreter start-up (tens of ms for Python and Node) happens in the background, before a request
exists; a request takes a sandbox whose interpreter is already blocked on its control pipe, and the
sandbox is destroyed after that one request. Nothing is ever reused between requests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Disposable(Protocol):
    def destroy(self) -> None: ...


T = TypeVar("T", bound=Disposable)


class WarmPool(Generic[T]):
    """Keeps up to `size` ready items made by `spawn`, refilled by background threads.

    Several spawns run at once (up to `spawners`, default min(size, 4)): much of a spawn's wall
    time is waiting, not CPU (moving a process into a cgroup waits for every fork and exit in
    progress on the host: up to ~12 ms median on a busy machine), and one refill thread waiting
    in series capped the pool at about 50 sandboxes/s whatever the core count."""

    def __init__(
        self, spawn: Callable[[], T], size: int, name: str = "warm-pool",
        spawners: int | None = None,
    ) -> None:
        self._spawn = spawn
        self.size = size
        self._ready: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self.failures = 0
        count = max(1, min(size, 4) if spawners is None else spawners)
        self._threads = [
            threading.Thread(target=self._refill, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def take(self) -> T | None:
        """A ready item, or None when the pool is empty (the caller then starts one cold)."""
        with self._cond:
            item = self._ready.popleft() if self._ready else None
            self._cond.notify_all()
            return item

    def wait_ready(self, timeout: float) -> bool:
        """Block until the pool is full and, for items that can tell (`wait_booted`), each one
        has finished starting (used by benchmarks and tests to start warm). A taken item may
        still be starting; whoever takes it just waits for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._closed or len(self._ready) >= self.size, timeout=timeout
            ):
                return False
            items = list(self._ready)
        for item in items:
            wait = getattr(item, "wait_booted", None)
            if wait is not None and not wait(max(deadline - time.monotonic(), 0.0)):
                return False
        return True

    def _refill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or len(self._ready) + self._in_flight < self.size)
                if self._closed:
                    return
                self._in_flight += 1
            try:
                item = self._spawn()
            except Exception:  # noqa: BLE001 - a failed spawn must not kill the refill thread
                with self._cond:
                    self._in_flight -= 1
                    self.failures += 1
                    self._cond.wait(timeout=min(0.05 * self.failures, 2.0))
                continue
            with self._cond:
                self._in_flight -= 1
                if self._closed:
                    item.destroy()
                    return
                self.failures = 0
                self._ready.append(item)
                self._cond.notify_all()

    def close(self) -> None:
        """Stop refilling and destroy every ready item."""
        with self._cond:
            self._closed = True
            items = list(self._ready)
            self._ready.clear()
            self._cond.notify_all()
        for item in items:
            with contextlib.suppress(Exception):
                item.destroy()
        for thread in self._threads:
            thread.join(timeout=10)
