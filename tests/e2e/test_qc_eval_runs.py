"""QC and evaluation as real runs: API → broker → a Celery worker process → engines → API.

A QC run of the arithmetic built-in marks its version passed; an eval run of the tiny-MoE
preset (served by the inference engine for the run) reports pass@k, readable per version.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import tenant
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ENVS = "teams/e2e/environments"
# 0..4 + 0..4: 25 problems, 3 held out; small enough for a CPU worker under load.
ARITH = {"source": "builtin", "name": "arithmetic",
         "params": {"max_operand": 4, "eval_size": 3}}


def _wait(client: CrucibleClient, run_id: str, worker) -> dict:
    try:
        done = client.wait_for_run("e2e", run_id, timeout=180)
    except TimeoutError:
        worker.terminate()
        raise AssertionError(worker.communicate(timeout=10)[0][-4000:]) from None
    if done["status"] != "succeeded":
        events = client.run_events("e2e", run_id)["results"]
        raise AssertionError(f"{done['status']}: {done['error']}\n"
                             + "\n".join(e["message"] for e in events))
    return done


def test_qc_then_eval_of_the_arithmetic_builtin(live_server, start_worker):
    token, worker_token = tenant()
    worker = start_worker(worker_token, queues="cpu,sandbox")
    with CrucibleClient(live_server.url, token) as client:
        client.request("POST", ENVS, json={"slug": "arith", "project": "demo"})
        version = client.request("POST", f"{ENVS}/arith/versions", json={"spec": ARITH})
        versions = f"{ENVS}/arith/versions/{version['digest']}"
        assert version["qc_status"] == "pending"

        qc = client.request("POST", f"{versions}/qc", json={"config": {"qc": {"repeats": 2}}})
        assert qc["pool"] == "sandbox"
        _wait(client, qc["id"], worker)
        checked = client.get(versions)
        assert checked["qc_status"] == "passed", checked["qc_report"]
        assert checked["blocked"] is False and checked["blocked_reason"] == ""
        assert checked["qc_report"]["summary"]["tasks"] == 25
        assert checked["qc_report"]["summary"]["quarantined"] == 0
        assert checked["qc_report"]["run"] == qc["id"]
        full = client.run_report("e2e", qc["id"])
        assert full["schema"] == "crucible.qc/1" and len(full["tasks"]) == 25
        rate = client.run_metrics("e2e", qc["id"], names=["qc/passed"])
        assert rate["series"][0]["points"][-1]["last"] == 1.0

        ev = client.request("POST", f"{versions}/eval", json={
            "base_model": "preset", "name": "base",
            "config": {"samples_per_task": 2, "k": [1, 2], "concurrency": 2,
                       "sampling": {"max_tokens": 6, "temperature": 1.0, "seed": 3}}})
        _wait(client, ev["id"], worker)
        report = client.run_report("e2e", ev["id"])
        assert report["schema"] == "crucible.eval/1"
        assert report["summary"]["tasks"] == 3 and report["summary"]["samples"] == 6
        assert set(report["summary"]["pass_at"]) == {"1", "2"}
        assert 0.0 <= report["summary"]["pass_at"]["1"] <= report["summary"]["pass_at"]["2"]
        # "auto" resolved to the prompt format the preset folder records: raw, as it trains
        assert report["policy"]["source"] == {"kind": "preset", "seed": 0, "chat_format": "raw"}
        assert report["environment"]["name"] == "arithmetic"
        metrics = client.run_metrics("e2e", ev["id"], names=["eval/pass@2"])
        assert metrics["series"][0]["points"][-1]["last"] == report["summary"]["pass_at"]["2"]
        samples = client.get(f"teams/e2e/runs/{ev['id']}/samples")["results"]
        assert len(samples) == 6  # every answer, with its task's prompt
        prompts = {s["prompt"] for s in samples}
        assert len(prompts) == 3 and all(p.endswith("=") and "+" in p for p in prompts)
        rows = client.get(f"{versions}/evals")
        assert [(r["run"], r["name"]) for r in rows] == [(ev["id"], "base")]
        assert rows[0]["summary"]["pass_at"] == report["summary"]["pass_at"]
