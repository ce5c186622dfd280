"""Run a profile: stream a dataset version's records from the object store, compute
statistics, report progress through a ``Reporter``, and store the report as JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from workers.profile.spec import ProfileConfig
from workers.profile.stats import Profile
from workers.protocol import DatasetPin
from workers.reporting import Reporter, Stopped
from workers.storage import ObjectStore


def profile_records(
    records: Iterable[bytes], config: ProfileConfig, sink: Reporter, total: int | None = None
) -> dict[str, Any]:
    profile = Profile()
    started = time.monotonic()
    limit = config.max_records
    for line in records:
        if limit is not None and profile.records + profile.invalid >= limit:
            break
        try:
            profile.add(json.loads(line))
        except ValueError:
            profile.invalid += 1
        seen = profile.records + profile.invalid
        if seen % config.progress_every == 0:
            if sink.should_stop():
                raise Stopped(f"stopped after {seen} records")
            elapsed = max(time.monotonic() - started, 1e-9)
            values = {"records_seen": float(seen), "records_per_s": seen / elapsed}
            if total:
                values["progress"] = seen / total
            sink.log(seen, values)
    seen = profile.records + profile.invalid
    elapsed = max(time.monotonic() - started, 1e-9)
    final = {"records_seen": float(seen), "records_per_s": seen / elapsed, "progress": 1.0,
             "duplicate_records": float(profile.duplicate_records)}
    sink.log(seen, final)
    report = profile.report(config.top_values)
    report["elapsed_s"] = round(elapsed, 4)
    return report


def run_profile(
    *, config: ProfileConfig, pinned: DatasetPin, store: ObjectStore, key: str, sink: Reporter
) -> tuple[dict[str, Any], str]:
    """Profile one pinned dataset version and store the report at ``key``; returns (report,
    report URI)."""
    sink.event("info", f"profiling {pinned.dataset} v{pinned.number} "
               f"({pinned.record_count} records)",
               {"digest": pinned.digest, "uri": pinned.uri})
    report = profile_records(store.open_lines(pinned.uri), config, sink,
                             total=pinned.record_count)
    report["dataset"] = {"dataset": pinned.dataset, "digest": pinned.digest,
                         "number": pinned.number}
    body = json.dumps(report, indent=2, sort_keys=True).encode()
    uri = store.put_bytes(key, body)
    sink.event("info", f"profile done: {report['records']} records, "
               f"{len(report['fields'])} fields, {report['duplicate_records']} duplicates",
               {"uri": uri})
    return report, uri
