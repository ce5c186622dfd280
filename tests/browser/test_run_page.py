"""In a real browser: log in, open a run, post metrics and events through the API, and
watch the page update without reloading."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.teams.models import Role
from apps.teams.services import worker_token_create
from tests.factories import (
    DatasetFactory,
    MembershipFactory,
    ProjectFactory,
    TeamFactory,
    UserFactory,
    make_run,
)
from workers.client import CrucibleClient

pytestmark = pytest.mark.slow
PASSWORD = "pw-for-tests-1"


def test_run_page_updates_live(asgi_server, browser):
    user = UserFactory(username="alice")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    run = make_run(project, DatasetFactory(project=project, team=team, slug="gsm"),
                   name="grpo-qwen3-moe-tiny")
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")

    page = browser.new_page(viewport={"width": 1366, "height": 900})
    page.goto(f"{asgi_server}/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{asgi_server}/t/lab/")
    assert page.locator(f'[data-run-status="{run.pk}"]').inner_text() == "queued"

    with CrucibleClient(asgi_server, worker_token) as client:
        session = client.claim("cpu", "gpu-node-7", run_id=str(run.pk))
        # The runs table hears the claim without a reload.
        page.wait_for_function(
            f"() => document.querySelector('[data-run-status=\"{run.pk}\"]').textContent"
            " === 'claimed'", timeout=10_000)

        page.click("text=grpo-qwen3-moe-tiny")
        page.wait_for_url(f"**/t/lab/runs/{run.pk}/")
        page.wait_for_selector("#live-indicator.on", timeout=10_000)
        page.evaluate("window.__noReload = true")

        session.set_status("running")
        for batch in range(4):
            steps = range(batch * 25, (batch + 1) * 25)
            session.log_metrics(
                [{"name": "reward/mean", "step": s, "value": 0.2 + 0.6 * s / 100} for s in steps]
                + [{"name": "loss", "step": s, "value": 2.0 / (1 + s / 10)} for s in steps]
                + [{"name": "kl", "step": s, "value": 0.001 * s} for s in steps]
            )
        session.log_event("step 100: mean reward 0.79", data={"step": 100})

        page.wait_for_selector('figure.chart[data-metric="reward/mean"] canvas', timeout=10_000)
        page.wait_for_selector('figure.chart[data-metric="kl"]', timeout=10_000)
        page.wait_for_selector("#events li:has-text('step 100: mean reward 0.79')",
                               timeout=10_000)
        page.wait_for_function(
            "() => document.getElementById('run-status').textContent === 'running'", timeout=10_000)
        assert page.evaluate("window.__noReload") is True  # the page was never reloaded
        assert page.locator("figure.chart").count() == 3
        assert '"progress_every": 1000' in page.locator("pre.config").inner_text()
        session.set_status("succeeded")
        page.wait_for_function(
            "() => document.getElementById('run-status').textContent === 'succeeded'",
            timeout=10_000)
