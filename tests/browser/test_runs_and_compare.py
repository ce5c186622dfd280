"""The runs table and compare in a real browser: column chooser with metric columns,
grouping, CSV export, nothing clipped at 1440 px with tags; compare started from a
selection, every run's value on hover, regressions marked in each metric's own direction
against a baseline the user picks — with no console error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.core.actor import Actor
from apps.runs.models import Run
from apps.teams.models import Role
from apps.teams.services import worker_token_create
from tests.browser.test_run_charts import login
from tests.factories import (
    make_lab,
    make_run,
    put_run_object,
)
from workers.client import CrucibleClient

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
WAIT = 15_000


@pytest.fixture
def lab(transactional_db):
    return make_lab(Role.MEMBER)


def seeded_runs(lab, asgi_server: str) -> list[Run]:
    tags = [["sweep-lr", "baseline", "seed-1", "long-tag-for-width"], ["sweep-lr", "seed-2"],
            []]
    runs = [make_run(lab["project"], lab["dataset"], name=f"profile-{n}", tags=t,
                     config={"top_values": 3 + i})
            for i, (n, t) in enumerate(zip(("a", "b", "c"), tags, strict=True))]
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    reports = [{"summary": {"latency_s": {"mean": 0.035}, "pass_at": {"1": 0.30}}},
               {"summary": {"latency_s": {"mean": 1.079}, "pass_at": {"1": 0.35}}},
               {"summary": {"latency_s": {"mean": 0.020}, "pass_at": {"1": 0.20}}}]
    with CrucibleClient(asgi_server, worker_token) as client:
        for i, run in enumerate(runs):
            session = client.claim("cpu", "w", run_id=str(run.pk))
            session.set_status("running")
            session.log_metrics([{"name": "reward_mean", "step": s, "value": (i + 1) * s / 10,
                                  "wall_time": 1.7e9 + s} for s in range(10)])
            uri = put_run_object(run, "report.json", json.dumps(reports[i]).encode())
            session.set_report(uri)
            session.set_status("succeeded")
    return runs


def test_runs_table_columns_groups_csv_and_compare(asgi_server, browser, lab):
    runs = seeded_runs(lab, asgi_server)
    page, errors = login(browser, asgi_server, "alice", width=1440)
    page.wait_for_selector("table.runs-table")
    # Nothing in the table is clipped at 1440 px, tags included.
    clipped = page.evaluate("""() => [...document.querySelectorAll('.runs-table td')]
        .filter((td) => td.scrollWidth > td.clientWidth + 1).length""")
    assert clipped == 0
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    tag = page.locator(f'tr:has(input[value="{runs[0].pk}"]) .chip', has_text="long-tag")
    assert tag.is_visible()

    # Column chooser: drop "Creator", add the last reward as a metric column.
    page.click("#column-chooser summary")
    page.uncheck('#column-chooser input[name="col"][value="creator"]')
    page.wait_for_function(
        "() => !document.querySelector('.runs-table th[data-col=\"creator\"]')", timeout=WAIT)
    page.select_option("#f-metric", "reward_mean:last")
    page.wait_for_selector('.runs-table th[data-col="reward_mean:last"]', timeout=WAIT)
    cell = page.locator(f'tr:has(input[value="{runs[2].pk}"]) td[data-col="reward_mean:last"]')
    assert cell.inner_text() == "2.7"
    assert page.locator('.runs-table th[data-col="creator"]').count() == 0  # kept on reload
    # Group by tag: a heading per tag, a run with two tags under both.
    page.select_option("#f-group", "tag")
    page.wait_for_selector('.runs-table tbody[data-group="sweep-lr"]', timeout=WAIT)
    groups = page.locator(".runs-table tbody[data-group]").evaluate_all(
        "els => els.map(e => e.dataset.group)")
    assert "(no tag)" in groups and "seed-1" in groups
    assert page.locator('tbody[data-group="sweep-lr"] input[name="run"]').count() == 2
    # CSV of every matching run in the chosen columns.
    with page.expect_download() as dl:
        page.click("#runs-csv")
    lines = Path(dl.value.path()).read_text().splitlines()
    assert lines[0].startswith("id,Run,") and "reward_mean (last)" in lines[0]
    assert "Creator" not in lines[0] and len(lines) == 4
    DOCS.mkdir(exist_ok=True)
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "runs-table.png"), full_page=True)

    # Compare from the selection.
    page.select_option("#f-group", "")
    page.wait_for_selector(".runs-table tbody:not([data-group])", timeout=WAIT)
    for run in runs:
        page.check(f'input[name="run"][value="{run.pk}"]')
    page.click("#compare-button")
    page.wait_for_url("**/t/lab/compare/?run=*")
    page.wait_for_selector("body[data-charts-ready]", timeout=WAIT)
    # Hover: one value per run in the tooltip and the legend.
    over = page.locator('#compare-charts figure.chart[data-metric="reward_mean"] .u-over')
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] * 0.5)
    tip = page.locator('#compare-charts figure.chart[data-metric="reward_mean"] .chart-tip')
    tip.wait_for(state="visible", timeout=WAIT)
    text = tip.inner_text()
    assert all(f"profile-{n}:" in text for n in "abc"), text
    # Regressions in each metric's direction: latency up is red, pass@1 up is green.
    def marks(key: str) -> list[str]:
        return page.locator(f'#report-table tr[data-key="{key}"] td').evaluate_all(
            "tds => tds.map(td => td.classList.contains('regression') ? 'worse' :"
            " td.classList.contains('improvement') ? 'better' : '')")
    assert marks("summary.latency_s.mean") == ["", "worse", "better"]
    assert marks("summary.pass_at.1") == ["", "better", "worse"]
    # Another baseline: the marks follow it.
    page.select_option("#baseline", str(runs[1].pk))
    page.wait_for_url("**baseline=*")
    assert marks("summary.latency_s.mean") == ["better", "", "better"]
    assert marks("summary.pass_at.1") == ["worse", "", "worse"]
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "compare.png"), full_page=True)
    assert errors == []
