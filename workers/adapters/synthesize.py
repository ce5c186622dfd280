"""``synthesize`` runs: generate and verify a batch, store it, and hand it to review as a
batch of ``config.dataset`` (accepted batches become that dataset's versions)."""

from __future__ import annotations

import time
from typing import Any

from workers.adapters.common import check_endpoint, dump, log_metrics
from workers.client import WorkerSession
from workers.profile.engine import Stopped
from workers.protocol import BatchHandOver
from workers.storage import default_store, run_key

REVIEW_FIELDS = ("target_error_rate", "confidence", "sample_seed")


class _Progress:
    """Synthesis progress → ``items_done`` / ``items_total`` metrics, at most once a second
    (and at the end); checks for cancellation on every report."""

    def __init__(self, session: WorkerSession, total: int, every_s: float = 1.0) -> None:
        self.session, self.total, self.every_s = session, total, every_s
        self.stages: dict[str, int] = {}
        self.step, self.last = 0, 0.0

    def __call__(self, progress: Any) -> None:
        if self.session.should_stop:
            raise Stopped(f"run {self.session.run_id} was canceled or its lease lost")
        if progress.stage in ("math", "model", "code"):
            self.stages[progress.stage] = progress.done
        now = time.monotonic()
        if progress.stage == "done" or now - self.last >= self.every_s:
            self.flush()
            self.last = now

    def flush(self) -> None:
        self.step += 1
        log_metrics(self.session, self.step, {"items_done": sum(self.stages.values()),
                                              "items_total": self.total})


def run(session: WorkerSession) -> None:
    """Synthesize, store records and rejects, hand the batch over, store the run report."""
    from workers.synthesis import parse_config, synthesize

    store = default_store()
    cfg = session.run.config
    config = parse_config(cfg["synthesis"])
    for generator in config.generators:
        endpoint = getattr(generator, "endpoint", None)
        if endpoint is not None:
            check_endpoint(endpoint.base_url)
    total = sum(g.count for g in config.generators)
    session.log_event(f"synthesis '{config.name}' started: {total} candidates planned",
                      data={"config": config.public_dict()})
    progress = _Progress(session, total)
    batch = synthesize(config, progress)
    progress.flush()
    key = run_key(session.run, "synthesis")
    records_uri = store.put_bytes(f"{key}/records.jsonl", batch.jsonl())
    rejected_uri = store.put_bytes(
        f"{key}/rejected.jsonl",
        b"".join(dump(r) + b"\n" for r in batch.rejected))
    review = cfg.get("review") or {}
    # The review plan's defaults are the hand-over's own (workers.protocol.BatchHandOver).
    created = session.hand_over_batch(BatchHandOver(
        dataset=cfg["dataset"], records=batch.records, manifest=batch.manifest,
        name=cfg.get("batch_name") or config.name,
        **{k: review[k] for k in REVIEW_FIELDS if k in review}))
    log_metrics(session, progress.step, {"accepted": len(batch.records),
                                         "rejected": len(batch.rejected)})
    report = {"schema": "crucible.synthesize-run/1", "batch": created.get("id"),
              "dataset": cfg["dataset"], "records": len(batch.records),
              "rejected": len(batch.rejected), "records_uri": records_uri,
              "rejected_uri": rejected_uri, "manifest": batch.manifest,
              "timings": batch.timings}
    uri = store.put_bytes(f"{key}/report.json", dump(report))
    session.log_event(f"synthesis done: {len(batch.records)} of {batch.manifest['candidates']} "
                      f"candidates verified; review batch {created.get('id')} for dataset "
                      f"'{cfg['dataset']}'", kind="artifact",
                      data={"batch": created.get("id"), "records_uri": records_uri})
    session.set_report(uri)
