"""A worker's reports held back while the control plane is unreachable, sent in order later.

Why: a web deploy, a PostgreSQL restart or a proxy hiccup of 20 s used to outlast the client's
retries (~15 s), failing the attempt and costing a retrain from the last checkpoint. With the
outbox, a report (metric batch, event, sample batch) that cannot be delivered is queued and
the engine keeps training; a thread sends the queue in order as soon as the API answers again,
each item with the idempotency it had from the start (a metric batch's ``seq``, an event's or
sample batch's ``Idempotency-Key``), so an item whose answer was lost is stored once.

Bounded: items are kept in memory up to ``memory_bytes`` (``CRUCIBLE_OUTBOX_MEMORY_BYTES``,
8 MiB), then spilled to files in ``spool`` up to ``disk_bytes``
(``CRUCIBLE_OUTBOX_DISK_BYTES``, 1 GiB); past that, :meth:`Outbox.put` waits for room (the
engine slows down rather than lose data). How long it keeps trying is the caller's ``send``'s
business: a session gives up when its lease would have expired.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 8 * 2**20
DEFAULT_DISK_BYTES = 2**30


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return max(0, int(raw)) if raw else default
    except ValueError:
        log.warning("%s must be a whole number of bytes, not %r: using %d", name, raw, default)
        return default


@dataclass
class Item:
    """One report: where it goes, its JSON body (in memory, or in ``file`` once spilled) and
    the headers it is sent with on every try (its idempotency key among them)."""

    path: str
    headers: dict[str, str]
    size: int
    body: bytes | None = None
    file: Path | None = None

    def content(self) -> bytes:
        if self.body is not None:
            return self.body
        assert self.file is not None
        return self.file.read_bytes()


class Outbox:
    """An ordered queue drained by one thread through ``send(item)``. ``send`` returns when the
    item is delivered (or is to be dropped) and raises to stop the outbox for good (the lease
    is gone): what is left is discarded, and :attr:`error` says why."""

    def __init__(self, send: Callable[[Item], None], spool: Path, *,
                 memory_bytes: int | None = None, disk_bytes: int | None = None,
                 name: str = "outbox") -> None:
        self.send, self.spool, self.name = send, spool, name
        self.memory_bytes = memory_bytes if memory_bytes is not None else _env_bytes(
            "CRUCIBLE_OUTBOX_MEMORY_BYTES", DEFAULT_MEMORY_BYTES)
        self.disk_bytes = disk_bytes if disk_bytes is not None else _env_bytes(
            "CRUCIBLE_OUTBOX_DISK_BYTES", DEFAULT_DISK_BYTES)
        self.items: deque[Item] = deque()
        self.in_memory = self.on_disk = 0
        self.spilled = 0  # items ever written to disk (for the log and tests)
        self.queued = 0  # items ever queued
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._sending = False
        self._closed = False
        self._counter = 0
        self._delivered = 0  # since the outbox was last empty

    def pending(self) -> bool:
        with self._cond:
            return bool(self.items) or self._sending

    def put(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        """Queue a report behind those already queued (never blocks while there is room)."""
        size = len(body)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed: {self.error}")
            item = Item(path, dict(headers), size)
            if self.in_memory + size <= self.memory_bytes:
                item.body = body
                self.in_memory += size
            else:
                while self.on_disk + size > self.disk_bytes and self.on_disk and \
                        not self._closed:
                    self._cond.wait(1.0)  # full: wait for the sender to make room
                if self._closed:
                    raise RuntimeError(f"{self.name} is closed: {self.error}")
                self.spool.mkdir(parents=True, exist_ok=True)
                self._counter += 1
                item.file = self.spool / f"{self._counter:012d}.json"
                item.file.write_bytes(body)
                self.on_disk += size
                self.spilled += 1
            self.items.append(item)
            self.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=self.name,
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self.items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = self.items[0]
                self._sending = True
            try:
                self.send(item)
            except BaseException as exc:  # noqa: BLE001 - the lease is gone: stop for good
                self.close(exc)
                return
            with self._cond:
                if self.items and self.items[0] is item:
                    self.items.popleft()
                    self._release(item)
                    self._delivered += 1
                self._sending = False
                if not self.items:
                    log.info("%s: the API is back; %d queued reports delivered in order",
                             self.name, self._delivered)
                    self._delivered = 0
                self._cond.notify_all()

    def _release(self, item: Item) -> None:
        if item.file is not None:
            self.on_disk -= item.size
            item.file.unlink(missing_ok=True)
        else:
            self.in_memory -= item.size

    def wait_empty(self, timeout: float | None = None) -> bool:
        """Whether everything queued was sent (False: timed out, or the outbox stopped)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (not self.items
                                                                and not self._sending),
                                       timeout) and not self._closed

    def close(self, error: BaseException | None = None) -> None:
        """Stop sending; drop what is left (with ``error``: why)."""
        with self._cond:
            if error is not None and self.error is None:
                self.error = error
            self._closed = True
            dropped = len(self.items)
            for item in self.items:
                self._release(item)
            self.items.clear()
            self._sending = False
            shutil.rmtree(self.spool, ignore_errors=True)
            self._cond.notify_all()
        if dropped:
            log.warning("%s: %d queued reports dropped (%s)", self.name, dropped,
                        error or "closed")
        shutil.rmtree(self.spool, ignore_errors=True)
