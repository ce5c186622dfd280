"""Records on a sandbox's feedback channel: framed, capped, and (where the writer is trusted)
authenticated.

Every record is `CRF1`, a 4-byte big-endian length, then the payload, so a record cannot be
spoofed by printing a line, nor glued onto another one by leaving out a newline. Channels whose
writer the candidate cannot reach (the status waiter, which is PID 1 and non-dumpable; a test
driver in its own sandbox under its own uid) start each payload with a per-execution key that
the supervisor generated and handed to that writer over a private fd, so a leaked descriptor
alone forges nothing. The Python and Node bootstraps' channel is written by the candidate's own
process, so its records (READY, EXIT, TRACE) are read as hints and checked against what the
supervisor sees from outside.

Parsing is incremental (each byte looked at once) and bounded: past `max_records` or
`max_bytes` the channel is flooded and the execution fails with that verdict, whatever it says.
(A channel that re-scanned its whole buffer for each chunk cost 3.7 s of supervisor CPU on one
flooded execution.)
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

MAGIC = b"CRF1"
KEY_BYTES = 16
MAX_RECORDS = 64
MAX_BYTES = 64 << 10


def frame(body: bytes, key: bytes = b"") -> bytes:
    """One record as its writer sends it (the engine's tests and the host-side writers)."""
    return MAGIC + (len(key) + len(body)).to_bytes(4, "big") + key + body


@dataclass
class RecordReader:
    """Feeds on a channel's bytes, keeps its complete records, stops at the first bad one."""

    key: bytes | None = None
    max_records: int = MAX_RECORDS
    max_bytes: int = MAX_BYTES
    records: list[tuple[str, str]] = field(default_factory=list)
    malformed: str = ""  # why the channel stopped being read, if it did
    flooded: bool = False
    _buf: bytearray = field(default_factory=bytearray)
    _seen: int = 0

    @property
    def stopped(self) -> bool:
        return bool(self.malformed) or self.flooded

    def feed(self, chunk: bytes) -> None:
        if self.stopped:
            return
        self._seen += len(chunk)
        if self._seen > self.max_bytes:
            self.flooded = True
            self.malformed = f"more than {self.max_bytes} bytes on the feedback channel"
            return
        self._buf += chunk
        while len(self._buf) >= 8:
            if self._buf[:4] != MAGIC:
                self.malformed = "bytes on the feedback channel that are not a record"
                return
            size = int.from_bytes(self._buf[4:8], "big")
            if size > self.max_bytes:
                self.malformed = f"a record of {size} bytes"
                return
            if len(self._buf) < 8 + size:
                return
            payload = bytes(self._buf[8:8 + size])
            del self._buf[:8 + size]
            if self.key is not None:
                if len(payload) < KEY_BYTES or not hmac.compare_digest(
                        payload[:KEY_BYTES], self.key):
                    self.malformed = "a record without this execution's key"
                    return
                payload = payload[KEY_BYTES:]
            if len(self.records) >= self.max_records:
                self.flooded = True
                self.malformed = f"more than {self.max_records} records on the feedback channel"
                return
            kind, _, value = payload.decode("utf-8", errors="replace").partition(" ")
            self.records.append((kind, value))

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished record are left over (the writer died mid-record)."""
        return bool(self._buf)

    def first(self, kind: str) -> str | None:
        return next((v for k, v in self.records if k == kind), None)

    def last(self, kind: str) -> str | None:
        return next((v for k, v in reversed(self.records) if k == kind), None)

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.records)
