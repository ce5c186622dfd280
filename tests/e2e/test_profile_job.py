"""The first real job end to end: HTTP API → Celery broker → worker process → HTTP API.

Runs on both configurations: filesystem broker + SQLite, and Redis + PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import tenant, wait_for
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DEMO = "deploy/demo/arithmetic.jsonl"


def test_profile_run_end_to_end_through_a_real_worker(live_server, start_worker):
    token, worker_token = tenant()
    worker = start_worker(worker_token)
    records = [json.loads(line) for line in Path(DEMO).read_text().splitlines()]
    with CrucibleClient(live_server.url, token) as client:
        client.create_dataset("e2e", "arith", "demo")
        version = client.upload_version("e2e", "arith", records)
        assert version["record_count"] == 250
        run = client.launch_run("e2e", project="demo", kind="profile", datasets=["arith"],
                                config={"progress_every": 50})
        try:
            done = client.wait_for_run("e2e", run["id"], timeout=120)
        except TimeoutError:
            worker.terminate()
            raise AssertionError(worker.communicate(timeout=10)[0][-4000:]) from None
        assert done["status"] == "succeeded", done["error"]
        assert done["attempt"] == 1

        report = client.run_report("e2e", run["id"])
        assert report["records"] == 250
        assert report["duplicate_records"] == 10  # the bundled file repeats 10 records
        assert report["dataset"]["digest"] == version["digest"]
        assert set(report["fields"]) == {"answer", "difficulty", "id", "prompt", "tags"}
        assert report["fields"]["difficulty"]["nulls"] > 0

        metrics = client.run_metrics("e2e", run["id"], names=["records_seen"])
        last = metrics["series"][0]["points"][-1]
        assert last["last"] == 250.0

        events = client.run_events("e2e", run["id"])["results"]
        messages = [e["message"] for e in events]
        seqs = [e["seq"] for e in events]  # metric batches take the positions in between
        assert seqs == sorted(set(seqs)) and seqs[0] == 1
        assert messages[0] == "queued" and messages[-1] == "succeeded"
        assert any(m.startswith("claimed") for m in messages)
        assert any(m.startswith("profile done") for m in messages)


def test_worker_skips_a_run_canceled_before_it_was_claimed(live_server, start_worker):
    token, worker_token = tenant()
    with CrucibleClient(live_server.url, token) as client:
        client.create_dataset("e2e", "arith", "demo")
        client.upload_version("e2e", "arith", [{"q": 1}])
        run = client.launch_run("e2e", project="demo", kind="profile", datasets=["arith"])
        client.cancel_run("e2e", run["id"])
        queued_later = client.launch_run("e2e", project="demo", kind="profile",
                                         datasets=["arith"])
        start_worker(worker_token)
        # The worker drains both messages; the canceled run must stay canceled.
        wait_for(lambda: client.run("e2e", queued_later["id"])["status"] == "succeeded",
                 what="second run to succeed")
        assert client.run("e2e", run["id"])["status"] == "canceled"


def test_run_of_a_dead_worker_is_requeued_and_finished_by_another(live_server, start_worker,
                                                                   settings):
    """A worker claims a run and dies (never heartbeats). Once its lease expires the next
    claim sweeps the run back to queued, and a live worker finishes it: attempt 2."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 2}
    token, worker_token = tenant()
    with CrucibleClient(live_server.url, token) as client, \
            CrucibleClient(live_server.url, worker_token) as dead:
        client.create_dataset("e2e", "arith", "demo")
        client.upload_version("e2e", "arith", [{"q": i} for i in range(20)])
        run = client.launch_run("e2e", project="demo", kind="profile", datasets=["arith"])
        assert dead.claim("cpu", "doomed-worker", run_id=run["id"]) is not None
        assert client.run("e2e", run["id"])["status"] == "claimed"
        wait_for(lambda: client.run("e2e", run["id"])["lease_expires_at"] is not None, 5)
        import time

        time.sleep(2.5)  # the lease runs out; nobody heartbeats
        start_worker(worker_token)
        done = wait_for(lambda: (r := client.run("e2e", run["id"]))["status"] == "succeeded"
                        and r, what="requeued run to succeed")
        assert done["attempt"] == 2
        messages = [e["message"] for e in client.run_events("e2e", run["id"])["results"]]
        assert any(m.startswith("preempted: lease held by doomed-worker expired")
                   for m in messages)
        assert messages.count("succeeded") == 1
