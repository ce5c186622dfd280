"""The worker's outbox: reports queued while the API is unreachable go out in order, spill to
disk past the memory bound, and are dropped (with the reason kept) when the lease is gone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from workers.outbox import Item, Outbox


class Gate:
    """A ``send`` that fails until opened (an outage of the API), recording what got through."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.sent: list[bytes] = []
        self.tries = 0

    def __call__(self, item: Item) -> None:
        self.tries += 1
        self.open.wait(10)
        self.sent.append(item.content())


def test_items_are_sent_in_order_and_spill_to_disk_past_the_memory_bound(tmp_path: Path):
    gate = Gate()
    box = Outbox(gate, tmp_path / "spool", memory_bytes=20, disk_bytes=10_000)
    bodies = [f'{{"n": {i}}}'.encode() for i in range(10)]  # 8-9 bytes each
    for body in bodies:
        box.put("worker/runs/x/metrics", body, {"Idempotency-Key": "k"})
    assert box.pending() and box.spilled >= 7
    assert len(list((tmp_path / "spool").iterdir())) == box.spilled and box.on_disk > 0
    gate.open.set()
    assert box.wait_empty(timeout=10)
    assert gate.sent == bodies
    assert box.in_memory == 0 and box.on_disk == 0
    assert not list((tmp_path / "spool").iterdir())
    box.close()


def test_a_full_outbox_makes_put_wait_for_room(tmp_path: Path):
    gate = Gate()
    box = Outbox(gate, tmp_path / "spool", memory_bytes=0, disk_bytes=16)
    box.put("p", b"0123456789", {})
    done = threading.Event()

    def second() -> None:
        box.put("p", b"abcdefghij", {})
        done.set()

    threading.Thread(target=second, daemon=True).start()
    assert not done.wait(0.5)  # 20 bytes would pass the 16-byte bound: it waits
    gate.open.set()
    assert done.wait(10) and box.wait_empty(timeout=10)
    assert gate.sent == [b"0123456789", b"abcdefghij"]
    box.close()


def test_a_send_that_raises_stops_the_outbox_and_drops_the_rest(tmp_path: Path):
    def send(item: Item) -> None:
        raise RuntimeError("lease lost")

    box = Outbox(send, tmp_path / "spool", memory_bytes=0, disk_bytes=1000)
    box.put("p", b"{}", {})
    assert not box.wait_empty(timeout=10)
    assert isinstance(box.error, RuntimeError) and not box.pending()
    with pytest.raises(RuntimeError):
        box.put("p", b"{}", {})
    assert not (tmp_path / "spool").exists()
