"""One MLflow writer process for bench_ingest.py; runs inside var/bench/mlflow-venv.

Not part of Crucible and imports nothing from it (the MLflow venv does not have Django). Protocol
on stdin/stdout, one JSON or keyword line each, prefixed ``BENCH`` so library chatter is ignored:

    stdin:  {"tracking_uri", "experiment_id", "batches", "batch_size", "names", "writer"}
    stdout: BENCH ready                 (run created, every batch built in memory)
    stdin:  go
    stdout: BENCH {"points": n, "elapsed": s, "run_id": id}
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    client = MlflowClient(tracking_uri=cfg["tracking_uri"])
    run = client.create_run(cfg["experiment_id"], run_name=f"ingest-writer-{cfg['writer']}")
    run_id = run.info.run_id
    names = cfg["names"]
    size = cfg["batch_size"]
    per_batch = size // len(names)
    now_ms = int(time.time() * 1000)
    # The same points the Crucible writers send: names x steps, steps increasing.
    batches = []
    for b in range(cfg["batches"]):
        batch = []
        for i in range(per_batch):
            step = b * per_batch + i
            for k, name in enumerate(names):
                batch.append(Metric(name, math.sin(step / 100.0 + k), now_ms + step, step))
        batches.append(batch)
    print("BENCH ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    start = time.perf_counter()
    points = 0
    for batch in batches:
        client.log_batch(run_id, metrics=batch, synchronous=True)
        points += len(batch)
    elapsed = time.perf_counter() - start
    client.set_terminated(run_id)
    print("BENCH " + json.dumps({"points": points, "elapsed": elapsed, "run_id": run_id}),
          flush=True)


if __name__ == "__main__":
    main()
