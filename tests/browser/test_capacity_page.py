"""The capacity planner in a real browser: a viewer reaches it from the team nav, plans
Qwen3-235B-A22B on H200s (the htmx answer replaces the planner block: GPUs needed, the
memory table, the layouts with the recommended one marked), then plans from a checkpoint's
saved config.json, and sees a pasted config's missing key named on the form; the page fits
800 px; no console error."""

from __future__ import annotations

import json

import pytest

from apps.runs.models import Checkpoint
from apps.teams.models import Role
from tests.apps.capacity.test_api import checkpoint_tar
from tests.browser.test_dashboard import no_sideways_scroll, screenshot
from tests.browser.test_run_charts import login
from tests.factories import make_lab, make_run, put_run_object
from workers.capacity import PRESETS

pytestmark = pytest.mark.slow
WAIT = 15_000


@pytest.fixture
def lab(transactional_db):
    lab = make_lab(Role.VIEWER)
    run = make_run(lab["project"], lab["dataset"], name="qwen3-8b-sft")
    uri = put_run_object(run, "checkpoints/final.tar", checkpoint_tar(
        {"hf/config.json": json.dumps(PRESETS["qwen3-8b"]).encode(),
         "hf/model.safetensors": b"w"}))
    Checkpoint.objects.create(run=run, team=run.team, step=200, uri=uri)
    return lab


def cell(page, table: str, row: str) -> str:
    return page.locator(f'#{table} tr[data-row="{row}"] td').inner_text()


def test_viewer_plans_from_a_preset_and_a_checkpoint(asgi_server, browser, lab):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header nav a:text('Capacity')")
    page.wait_for_url(f"{asgi_server}/t/lab/capacity/")
    assert page.locator("h1").inner_text() == "Capacity planner"

    page.select_option("#id_source", "preset")
    page.select_option("#id_preset", "qwen3-235b-a22b")
    page.select_option("#id_gpu", "H200-141GB")
    page.fill("#id_concurrency", "32")
    page.fill("#id_context", "32768")
    page.click("button:text('Plan')")
    page.wait_for_selector("#gpus-needed", timeout=WAIT)
    assert page.url == f"{asgi_server}/t/lab/capacity/"  # swapped in place by htmx
    summary = page.inner_text("#gpus-needed")
    assert summary.startswith("8 × H200-141GB: TP 4, EP 8, 2 replicas")
    assert page.inner_text("#plan-h") == "qwen3-235b-a22b on NVIDIA H200 SXM 141GB"
    assert page.inner_text("#params-total") == "235.09 B"
    assert page.inner_text("#params-active") == "22.19 B"
    # weights 470,187,269,120 B; KV 94 layers * 2 * 4 heads * 128 * 2 B = 192,512 B/token,
    # 6.31 GB per 32k sequence, 201.9 GB for 32 of them
    assert cell(page, "memory", "weights") == "470.2 GB"
    assert cell(page, "memory", "kv-token") == "192.5 KB"
    assert cell(page, "memory", "kv-sequence") == "6.31 GB"
    assert cell(page, "memory", "kv-total") == "201.9 GB"
    assert page.locator('#weights-by-dtype tr[data-dtype="fp8"] td').inner_text() == "236.4 GB"
    recommended = page.locator("#layouts tr.recommended")
    assert recommended.count() == 1
    assert recommended.get_attribute("data-layout") == "tp4-epon"
    assert recommended.locator(".gpus").inner_text() == "8"
    assert recommended.locator(".fits").inner_text() == "fits"
    # TP 1 without EP never holds 470 GB of weights on a 141 GB GPU
    assert page.locator('#layouts tr[data-layout="tp1-epoff"] .fits').inner_text() == "too big"
    screenshot(page, "capacity.png")
    no_sideways_scroll(page)

    # From the team's checkpoint: its saved config.json is Qwen3-8B
    page.select_option("#id_source", "checkpoint")
    page.select_option("#id_checkpoint", label="qwen3-8b-sft @ step 200")
    page.fill("#id_concurrency", "8")
    page.fill("#id_context", "8192")
    page.click("button:text('Plan')")
    page.wait_for_selector("#plan-h:has-text('qwen3-8b-sft @ step 200')", timeout=WAIT)
    assert page.inner_text("#params-total") == "8.19 B"
    assert page.inner_text("#gpus-needed").startswith("1 × H200-141GB: TP 1")

    # A pasted config without hidden_size: the error is on the config field, no plan
    page.select_option("#id_source", "config")
    page.fill("#id_config", json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                        "vocab_size": 10}))
    page.click("button:text('Plan')")
    page.wait_for_selector(".field.has-error #err_config", timeout=WAIT)
    assert "config.hidden_size is missing" in page.inner_text("#err_config")
    assert page.locator("#layouts").count() == 0
    assert errors == [], "\n".join(errors)
