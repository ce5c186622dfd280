"""``synthesize`` runs: generate and verify a batch, store it, and hand it to review as a
batch of ``config.dataset`` (accepted batches become that dataset's versions)."""

from __future__ import annotations

from workers.adapters.common import ApiReporter, check_endpoint, dump
from workers.client import WorkerSession
from workers.protocol import BatchHandOver
from workers.storage import default_store, run_key


def run(session: WorkerSession) -> None:
    """Synthesize, store records and rejects, hand the batch over, store the run report."""
    from workers.synthesis import ItemProgress, parse_run_config, synthesize

    store = default_store()
    reporter = ApiReporter(session, store)
    cfg = parse_run_config(session.run.config)
    config = cfg.synthesis
    for generator in config.generators:
        endpoint = getattr(generator, "endpoint", None)
        if endpoint is not None:
            check_endpoint(endpoint.base_url)
    total = sum(g.count for g in config.generators)
    reporter.event("info", f"synthesis '{config.name}' started: {total} candidates planned",
                   {"config": config.public_dict()})
    progress = ItemProgress(reporter, total)
    batch = synthesize(config, progress)
    progress.flush()
    key = run_key(session.run, "synthesis")
    records_uri = store.put_bytes(f"{key}/records.jsonl", batch.jsonl())
    rejected_uri = store.put_bytes(
        f"{key}/rejected.jsonl",
        b"".join(dump(r) + b"\n" for r in batch.rejected))
    created = session.hand_over_batch(BatchHandOver(
        dataset=cfg.dataset, records=batch.records, manifest=batch.manifest,
        name=cfg.batch_name or config.name, target_error_rate=cfg.review.target_error_rate,
        confidence=cfg.review.confidence, sample_seed=cfg.review.sample_seed))
    reporter.log(progress.step, {"accepted": len(batch.records),
                                 "rejected": len(batch.rejected)})
    report = {"schema": "crucible.synthesize-run/1", "batch": created.get("id"),
              "dataset": cfg.dataset, "records": len(batch.records),
              "rejected": len(batch.rejected), "records_uri": records_uri,
              "rejected_uri": rejected_uri, "manifest": batch.manifest,
              "timings": batch.timings}
    uri = store.put_bytes(f"{key}/report.json", dump(report))
    reporter.event("info", f"synthesis done: {len(batch.records)} of "
                   f"{batch.manifest['candidates']} candidates verified; review batch "
                   f"{created.get('id')} for dataset '{cfg.dataset}'",
                   {"batch": created.get("id"), "records_uri": records_uri}, kind="artifact")
    session.set_report(uri)
