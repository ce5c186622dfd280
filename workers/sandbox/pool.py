"""Warm pool: pre-started, single-use sandboxes for interpreted languages.

Interpreter start-up (tens of ms for Python and Node) happens in the background, before a request
exists; a request takes a sandbox whose interpreter is already blocked on its control pipe, and the
sandbox is destroyed after that one request. Nothing is ever reused between requests.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Disposable(Protocol):
    def destroy(self) -> None: ...


T = TypeVar("T", bound=Disposable)


class WarmPool(Generic[T]):
    """Keeps up to `size` ready items made by `spawn`, refilled by one background thread."""

    def __init__(self, spawn: Callable[[], T], size: int, name: str = "warm-pool") -> None:
        self._spawn = spawn
        self.size = size
        self._ready: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.failures = 0
        self._thread = threading.Thread(target=self._refill, name=name, daemon=True)
        self._thread.start()

    def take(self) -> T | None:
        """A ready item, or None when the pool is empty (the caller then starts one cold)."""
        with self._cond:
            item = self._ready.popleft() if self._ready else None
            self._cond.notify_all()
            return item

    def wait_ready(self, timeout: float) -> bool:
        """Block until the pool is full (used by benchmarks and tests to start warm)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or len(self._ready) >= self.size, timeout=timeout
            )

    def _refill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or len(self._ready) < self.size)
                if self._closed:
                    return
            try:
                item = self._spawn()
            except Exception:  # noqa: BLE001 - a failed spawn must not kill the refill thread
                self.failures += 1
                with self._cond:
                    self._cond.wait(timeout=min(0.05 * self.failures, 2.0))
                continue
            with self._cond:
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
        self._thread.join(timeout=10)
