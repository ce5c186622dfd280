"""An eval run carrying a served variant's settings, executed by the real eval adapter: the
worker serves the model with int8 weights and n-gram speculative decoding, says so in its
event and report, and finishes the evaluation."""

from __future__ import annotations

import json

import pytest
import torch

from apps.runs.models import Run, RunEvent
from workers.adapters import eval as eval_adapter

pytestmark = pytest.mark.django_db


def test_eval_worker_serves_the_variant(arith, api, pool, object_store, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("OBJECT_STORE_URL", object_store.url)  # the worker's store is the web's
    run = api.launch_run("acme", project="main", kind="eval", environment="arith@v1",
                         base_model="preset", config={
                             "sampling": {"max_tokens": 4}, "limit": 2,
                             "serving": {"int8": True, "ngram_draft": 2}})
    session = pool.claim("cpu", "w1", run_id=run["id"])
    eval_adapter.run(session)
    events = [e.data for e in RunEvent.objects.filter(run_id=run["id"])
              if "served here" in e.message]
    assert events and events[0]["policy"]["serving"]["int8"] is True
    assert events[0]["policy"]["serving"]["ngram_draft"] == 2
    assert events[0]["policy"]["served"] == {"weights": "int8", "speculative": "ngram"}
    stored = Run.objects.get(pk=run["id"])
    report = json.loads(object_store.get_bytes(stored.report_uri))
    assert report["policy"]["source"]["serving"] == {
        "int8": True, "ngram_draft": 2, "draft": None, "num_speculative_tokens": 4}
    assert report["policy"]["source"]["served"] == {"weights": "int8", "speculative": "ngram"}
    assert report["summary"]["tasks"] == 2
