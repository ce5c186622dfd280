"""One metric-writing client process, as a training rank is: claim a run through the worker
API, then log metric batches with the real client (``WorkerSession.log_metrics``), which
retries a batch with the same ``seq`` until the API takes it (its outbox holds batches while
no web process answers). Shared by the concurrent-ingest e2e test and ``bench_ingest.py``.

Run: ``python -m tests.e2e.metric_writer`` with one JSON line on stdin::

    {"url", "token", "run_id", "names": [...], "steps": n, "batch_size": points,
     "body"?: "msgpack" | "json-columns" | "json-rows", "start"?: 0}

It writes ``names x steps`` points, steps ``start .. start+steps-1``, ``batch_size`` points a
batch (whole steps: each batch holds every name at ``batch_size // len(names)`` steps), value
``step + k / 1000`` for the k-th name, so a reader can check every stored value. It prints
``BENCH ready`` once claimed, waits for a ``go`` line, sends, waits until its outbox is
empty, and prints ``BENCH {"points", "batches", "buffered", "elapsed"}`` (points sent).
No database access: a client holds no credentials but its token.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from workers.client import CrucibleClient


def value_of(step: int, k: int) -> float:
    """The value written for the k-th name at ``step`` (checked back by the readers)."""
    return step + k / 1000


def main() -> int:
    cfg: dict[str, Any] = json.loads(sys.stdin.readline())
    client = CrucibleClient(cfg["url"], cfg["token"], timeout=120,
                            metric_encoding=cfg.get("body", "msgpack"))
    session = client.claim("cpu", f"writer-{socket.gethostname()}-{os.getpid()}",
                           run_id=cfg["run_id"])
    if session is None:
        print(f"run {cfg['run_id']} could not be claimed", file=sys.stderr)
        return 1
    session.start_heartbeat()
    names: list[str] = cfg["names"]
    per_batch = max(1, cfg["batch_size"] // len(names))
    start, steps = int(cfg.get("start", 0)), int(cfg["steps"])
    print("BENCH ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    began = time.perf_counter()
    sent = batches = buffered = 0
    for first in range(start, start + steps, per_batch):
        last = min(first + per_batch, start + steps)
        # Built a batch at a time: 16 writers holding 10M point dicts would not fit.
        batch = [{"name": name, "step": step, "value": value_of(step, k),
                  "wall_time": 1.7e9 + step}
                 for step in range(first, last) for k, name in enumerate(names)]
        answer = session.log_metrics(batch)
        sent += len(batch)
        batches += 1
        buffered += bool(answer.get("buffered"))
    session.flush()  # every queued batch delivered (or LeaseLost raised)
    elapsed = time.perf_counter() - began
    session.stop_heartbeat()
    print("BENCH " + json.dumps({"points": sent, "batches": batches, "buffered": buffered,
                                 "elapsed": elapsed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
