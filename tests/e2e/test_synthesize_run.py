"""A synthesize run on a real Celery worker: the engine generates and verifies a few math
items, reports progress, and hands the verified records to the review app as a batch of the
run's dataset (linked to the run)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import tenant
from tests.e2e.test_qc_eval_runs import _wait
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_synthesize_run_creates_a_review_batch(live_server, start_worker):
    token, worker_token = tenant()
    worker = start_worker(worker_token)
    with CrucibleClient(live_server.url, token) as client:
        client.create_dataset("e2e", "synth", "demo")
        run = client.launch_run("e2e", project="demo", kind="synthesize", config={
            "dataset": "synth", "batch_name": "e2e batch",
            "synthesis": {"name": "tiny", "seed": 7, "workers": 1,
                          "generators": [{"kind": "math", "count": 4,
                                          "topics": ["arithmetic", "linear"],
                                          "difficulties": [1]}]},
            "review": {"target_error_rate": 0.2, "confidence": 0.8, "sample_seed": 1}})
        assert run["pool"] == "cpu"
        _wait(client, run["id"], worker)

        report = client.run_report("e2e", run["id"])
        assert report["schema"] == "crucible.synthesize-run/1"
        assert report["records"] + report["rejected"] == 4 and report["records"] >= 1
        batches = client.get("teams/e2e/batches")["results"]
        assert [(b["id"], b["name"], b["run"], b["record_count"]) for b in batches] == [
            (report["batch"], "e2e batch", run["id"], report["records"])]
        assert batches[0]["digest"] == report["manifest"]["records_digest"]
        done = client.run_metrics("e2e", run["id"], names=["items_done", "items_total"])
        last = {s["name"]: s["points"][-1]["last"] for s in done["series"]}
        assert last == {"items_done": 4.0, "items_total": 4.0}
