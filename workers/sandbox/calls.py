"""The supervisor's side of call cases: each call crosses to the candidate's call server by value,
and the result is compared here, on plain data, by `scoring.values_equal`.

No test code runs anywhere, so the comparison needs no sandbox of its own: the candidate can only
answer, and an answer is a JSON document the supervisor decodes into builtin values (capped in
size, and read with a deadline, so a silent or flooding candidate costs it the call, not the
host). The call servers are the Python and Node bootstraps in serve mode and the Ruby, PHP and
Lua servers under harness/.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence
from typing import Any

from .harness import wire
from .scoring import values_equal
from .spec import CallCase, CallResult

MAX_REPLY = 1 << 20
"""Bytes one reply may take: the supervisor decodes it, so it is capped far below WIRE_MAX."""


class _Gone(Exception):
    pass


class _Channel:
    """Framed messages over a pipe pair, every wait bounded by one deadline."""

    def __init__(self, read_fd: int, write_fd: int, deadline: float) -> None:
        self.read_fd, self.write_fd, self.deadline = read_fd, write_fd, deadline
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def _wait(self, fd: int, event: int) -> None:
        poller = select.poll()
        poller.register(fd, event)
        left = self.deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("the candidate did not answer in time")

    def send(self, message: Any) -> None:
        data = memoryview(wire.frame(wire.dumps(message)))
        while data:
            self._wait(self.write_fd, select.POLLOUT)
            try:
                data = data[os.write(self.write_fd, data):]
            except BlockingIOError:
                continue
            except OSError as exc:  # EPIPE: the candidate is gone
                raise _Gone() from exc

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            self._wait(self.read_fd, select.POLLIN)
            try:
                chunk = os.read(self.read_fd, min(n - got, 1 << 16))
            except BlockingIOError:
                continue
            if not chunk:
                raise _Gone()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def receive(self) -> Any:
        size = int.from_bytes(self._read(4), "big")
        if size > MAX_REPLY:
            raise wire.WireError(f"a reply of {size} bytes (at most {MAX_REPLY})")
        return wire.loads(self._read(size))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def drive(
    read_fd: int, write_fd: int, calls: Sequence[CallCase], deadline: float
) -> tuple[list[CallResult], str]:
    """Run every call against the candidate; (one result per call, why it stopped early or
    ""). Closes write_fd at the end, which tells the candidate's server to finish."""
    results: list[CallResult] = []
    channel = _Channel(read_fd, write_fd, deadline)
    stopped = ""
    try:
        hello = channel.receive()
        if isinstance(hello, list) and hello[:1] == ["loadfail"]:
            stopped = f"the candidate raised {str(hello[1:2])[:80]} while loading"
        elif not (isinstance(hello, list) and hello[:1] in (["ready"], ["names"])):
            stopped = "the candidate did not announce its functions"
        for call in calls:
            if stopped:
                break
            channel.send(["call", call.function, list(call.args), {}])
            reply = channel.receive()
            result = CallResult(function=call.function)
            if isinstance(reply, list) and len(reply) == 2 and reply[0] == "ok":
                result.got = _shown(reply[1])
                result.passed = values_equal(
                    reply[1], call.expected, tolerant=call.comparison == "tolerant",
                    abs_tol=call.abs_tol, rel_tol=call.rel_tol)
                if not result.passed:
                    result.error = "wrong result"
            elif isinstance(reply, list) and len(reply) == 3 and reply[0] == "raise":
                result.error = f"raised {str(reply[1])[:80]}: {str(reply[2])[:200]}"
            else:
                result.error = "a malformed reply"
            results.append(result)
    except _Gone:
        stopped = "the candidate exited while a call was being made"
    except TimeoutError as exc:
        stopped = str(exc)
    except wire.WireError as exc:
        stopped = f"the candidate sent a malformed reply ({exc})"
    finally:
        os.close(write_fd)
    for call in calls[len(results):]:
        results.append(CallResult(function=call.function, error=stopped or "not called"))
    return results, stopped
