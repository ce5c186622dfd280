"""The dashboard in a real browser: launch a run from the form and watch it go live,
compare two runs (the config diff shows only differing keys), and create and revoke an API
token. Each test saves a screenshot of its page under docs/ and checks that the page does
not overflow sideways at 800 px."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.core.actor import Actor
from apps.runs.models import Run
from apps.teams.models import ApiToken, Role
from apps.teams.services import worker_token_create
from tests.factories import (
    make_lab,
    make_run,
)
from workers.client import CrucibleClient

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
PASSWORD = "pw-for-tests-1"
WAIT = 10_000


def login(browser, server: str, username: str, width: int = 1280):
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(f"{server}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/t/**")
    return page


def no_sideways_scroll(page, width: int = 800) -> None:
    """At ``width`` px the page itself must not scroll sideways (wide tables scroll in
    their own box)."""
    page.set_viewport_size({"width": width, "height": 900})
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{page.url} is {overflow}px too wide at {width}px"
    page.set_viewport_size({"width": 1280, "height": 900})


def screenshot(page, name: str) -> None:
    DOCS.mkdir(exist_ok=True)
    # A sticky bar would be painted mid-page in a full-page capture.
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / name), full_page=True)


@pytest.fixture
def lab(transactional_db):
    return make_lab(Role.ADMIN)


def test_launch_from_form_and_watch_it_go_live(asgi_server, browser, lab):
    make_run(lab["project"], lab["dataset"], name="older-profile")
    page = login(browser, asgi_server, "alice")
    page.wait_for_selector("table.runs-table")
    no_sideways_scroll(page)

    page.click("text=Launch a run")
    page.click("text=Profile a dataset version")
    page.select_option("#id_datasets", ["gsm"])
    page.fill("#id_name", "profile-from-form")
    # A typo in the config is refused with the field named, next to the config box.
    page.fill("#id_config", '{"top_valuez": 3}')
    page.click("button[value=preview]")
    assert "top_valuez: unknown field" in page.locator("#err_config").inner_text() or \
        "top_valuez" in page.locator("#err_config").inner_text()
    assert page.get_attribute("#id_config", "aria-invalid") == "true"
    page.fill("#id_config", '{"top_values": 3}')
    page.click("button[value=preview]")
    page.wait_for_selector("#preview")
    assert '"record_count": 8' in page.locator("#preview").inner_text()
    assert not Run.objects.filter(name="profile-from-form").exists()
    no_sideways_scroll(page)
    screenshot(page, "launch.png")

    page.click("button[value=launch]")
    page.wait_for_url("**/t/lab/runs/*/")
    run = Run.objects.get(name="profile-from-form")
    assert run.created_by == lab["user"] and run.config["top_values"] == 3
    assert page.locator("#run-status").inner_text() == "queued"
    page.wait_for_selector("#live-indicator.on", timeout=WAIT)
    page.evaluate("window.__noReload = true")

    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    with CrucibleClient(asgi_server, worker_token) as client:
        session = client.claim("cpu", "cpu-node-1", run_id=str(run.pk))
        session.set_status("running")
        page.wait_for_function(
            "() => document.getElementById('run-status').textContent === 'running'", timeout=WAIT)
        steps = range(20)
        points = [{"name": "reward_mean", "step": s, "value": s / 20} for s in steps]
        points += [{"name": "loss", "step": s, "value": 1 / (1 + s)} for s in steps]
        points += [{"name": "gen_tokens_per_s", "step": s, "value": 900 + s} for s in steps]
        session.log_metrics(points)
        session.log_event("debug detail", level="debug")
        session.log_event("step 20: reward 0.95")

        page.wait_for_selector('#group-reward figure.chart[data-metric="reward_mean"] canvas',
                               timeout=WAIT)
        page.wait_for_selector('#group-throughput figure.chart[data-metric="gen_tokens_per_s"]',
                               timeout=WAIT)
        # Sections that do not apply to a profile run are left out.
        for heading in ("#experts-h", "#ckpt-h", "#samples-h"):
            assert page.locator(heading).count() == 0
        page.wait_for_selector("#events li:has-text('step 20: reward 0.95')", timeout=WAIT)
        assert not page.locator("#events li:has-text('debug detail')").is_visible()
        page.check('.level-filter input[value="debug"]')
        assert page.locator("#events li:has-text('debug detail')").is_visible()

        session.set_status("succeeded")
        page.wait_for_function(
            "() => document.getElementById('run-status').textContent === 'succeeded'", timeout=WAIT)
    assert page.evaluate("window.__noReload") is True
    no_sideways_scroll(page)
    screenshot(page, "run-page-live.png")
    # (the samples viewer is tested on a train run: tests/browser/test_run_charts.py)

    # A few more runs, so the table's screenshot shows a working team.
    for name in ("profile-gsm-full", "profile-gsm-sample"):
        make_run(lab["project"], lab["dataset"], name=name, config={"max_records": 4})
    page.goto(f"{asgi_server}/t/lab/")
    assert page.locator(f'[data-run-status="{run.pk}"]').inner_text() == "succeeded"
    # (docs/runs-table.png and docs/compare.png come from test_runs_and_compare.py)


def test_compare_two_runs_shows_only_differing_keys(asgi_server, browser, lab):
    a = make_run(lab["project"], lab["dataset"], name="top-5", config={"top_values": 5})
    b = make_run(lab["project"], lab["dataset"], name="top-9",
                 config={"top_values": 9, "max_records": 4})
    make_run(lab["project"], lab["dataset"], name="not-compared")
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    with CrucibleClient(asgi_server, worker_token) as client:
        for i, run in enumerate((a, b)):
            session = client.claim("cpu", "w", run_id=str(run.pk))
            session.log_metrics([{"name": "reward_mean", "step": s, "value": s * (i + 1) / 10}
                                 for s in range(10)])

    page = login(browser, asgi_server, "alice")
    page.check(f'input[name="run"][value="{a.pk}"]')
    assert page.is_disabled("#compare-button")
    # The selection survives a filter change (the table is swapped by htmx).
    page.select_option("#f-kind", "profile")
    page.wait_for_function(
        "() => document.getElementById('compare-count')?.textContent === '1'", timeout=WAIT)
    page.check(f'input[name="run"][value="{b.pk}"]')
    page.click("#compare-button")
    page.wait_for_url("**/t/lab/compare/?run=*")

    visible = page.locator("#config-table tbody tr[data-key]:visible")
    assert sorted(visible.evaluate_all("rows => rows.map(r => r.dataset.key)")) == [
        "max_records", "top_values"]
    page.check("#show-all-keys")
    assert page.locator("#config-table tbody tr[data-key]:visible").count() == 4
    page.uncheck("#show-all-keys")
    page.wait_for_selector('#compare-charts figure.chart[data-metric="reward_mean"] canvas',
                           timeout=WAIT)
    no_sideways_scroll(page)


def test_team_tokens_create_show_once_and_revoke(asgi_server, browser, lab):
    page = login(browser, asgi_server, "alice")
    page.click("nav.tabs >> text=Team")
    page.wait_for_selector("#members")
    page.fill("#personal-name", "laptop")
    page.click("text=Create token")
    secret = page.locator("#new-token-secret").input_value()
    token = ApiToken.objects.get(user=lab["user"], name="laptop")
    assert token.prefix in secret
    page.fill("#worker-name", "gpu-pool-a")
    page.click("text=Create worker token")
    assert page.locator("#new-token-secret").input_value().startswith("crw_")
    screenshot(page, "team.png")

    page.goto(f"{asgi_server}/t/lab/team/")
    assert secret not in page.content()  # shown once
    page.on("dialog", lambda dialog: dialog.accept())
    page.click(f'#personal-tokens tr[data-prefix="{token.prefix}"] >> text=Revoke')
    page.wait_for_selector(f'#personal-tokens tr[data-prefix="{token.prefix}"] >> text=revoked')
    token.refresh_from_db()
    assert token.revoked_at is not None
    no_sideways_scroll(page)
