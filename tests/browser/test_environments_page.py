"""Environment pages in a real browser: from the Environments tab to a version whose QC
blocked it (quarantined tasks with their reasons, a duplicate flag) and which has an eval
report; launch a QC run from the page; no layout break at 800 px; a screenshot for docs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.core.actor import Actor
from apps.environments import services
from apps.runs import services as run_services
from apps.runs.models import Run, RunStatus
from apps.runs.validation import plan_run
from apps.teams.models import Role
from tests.apps.runs.test_environment_pages import EVAL_REPORT, QC_REPORT
from tests.factories import (
    MembershipFactory,
    ProjectFactory,
    TeamFactory,
    UserFactory,
    put_run_object,
)

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
PASSWORD = "pw-for-tests-1"
SPEC = {"env": {"source": "tasks",
                "tasks": [{"id": f"t-{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i),
                           "split": "eval" if i % 2 else "train", "topic": "fractions"}
                          for i in range(4)],
                "rubric": {"components": [{"name": "correct", "checker": "math_equiv"}]}},
        "description": "Small sums with checked answers."}


def test_version_page_with_qc_and_eval_reports(asgi_server, browser):
    user = UserFactory(username="erin")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    actor = Actor.of_user(user)
    env = services.environment_create(actor=actor, team=team, project=project, slug="sums",
                                      description="arithmetic with verifiable answers")
    version, _ = services.version_register(actor=actor, environment=env, spec=SPEC)
    plan = plan_run(team=team, project="math", kind="eval", config={"samples_per_task": 4,
                                                                    "k": [1, 4]},
                    name="tiny-moe base", base_model="preset", environment="sums@v1")
    run = run_services.create_run(actor=actor, team_id=team.pk, plan=plan)
    uri = put_run_object(run, "eval-report.json", json.dumps(EVAL_REPORT).encode())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, report_uri=uri)
    # A second evaluation, of a training run's checkpoint: its report names the checkpoint.
    from apps.runs.models import Checkpoint
    from tests.factories import make_train_run

    trained = make_train_run(project, name="sft-grpo-sums")
    ckpt_uri = put_run_object(trained, "checkpoints/final.tar", b"weights")
    Checkpoint.objects.create(run=trained, team=team, step=5, uri=ckpt_uri)
    plan = plan_run(team=team, project="math", kind="eval", config={"samples_per_task": 4,
                                                                    "k": [1, 4]},
                    name="trained", base_model=f"run:{trained.pk}", environment="sums@v1")
    of_ckpt = run_services.create_run(actor=actor, team_id=team.pk, plan=plan)
    uri2 = put_run_object(of_ckpt, "eval-report.json", json.dumps(EVAL_REPORT).encode())
    Run.objects.filter(pk=of_ckpt.pk).update(status=RunStatus.SUCCEEDED, report_uri=uri2)
    # QC reported after that evaluation and blocked the version.
    services.record_qc_report(actor=Actor.system(), version=version, report=QC_REPORT,
                              run_id="", report_uri="file:///store/qc-report.json")

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{asgi_server}/accounts/login/")
    page.fill("#id_username", "erin")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{asgi_server}/t/**")
    page.click("nav.tabs >> text=Environments")
    page.wait_for_url("**/t/lab/environments/")
    assert "blocked" in page.inner_text('tr[data-environment="sums"]')
    page.click("text=sums")
    page.wait_for_url("**/t/lab/environments/sums/")
    page.click("#env-versions >> text=v1")
    page.wait_for_url("**/t/lab/environments/sums/v1/")

    assert page.inner_text("#qc-status").lower() == "qc failed"
    assert "quarantined 2 of 4 tasks" in page.inner_text("#blocked-reason")
    assert "4 uploaded tasks" in page.inner_text("#spec-summary")
    assert "reference earns 0.0 < 1.0" in page.inner_text('#quarantined tr[data-task="t-17"]')
    assert "<b>5</b>" in page.inner_text('#quarantined tr[data-task="t-23"]')  # text, not markup
    assert page.locator("#quarantined b").count() == 0
    assert "t-1" in page.inner_text('#qc-flags tr[data-flag="exact_duplicate"]')
    report = page.locator(f'.eval-report[data-run="{run.pk}"]')
    assert "0.813" in report.locator(".eval-summary").inner_text()
    assert report.locator("table.by-difficulty tbody tr").count() == 2
    # Reports name what they evaluated, not the local server they talked to.
    assert "evaluated the built-in tiny preset model" in report.locator("h3").inner_text()
    named = page.locator(f'.eval-report[data-run="{of_ckpt.pk}"] h3').inner_text()
    assert "evaluated checkpoint @ step 5 of train run sft-grpo-sums" in named
    assert "policy@" not in page.inner_text("#eval-reports")

    page.set_viewport_size({"width": 800, "height": 900})
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"environment version page is {overflow}px too wide at 800px"
    page.set_viewport_size({"width": 1280, "height": 900})
    DOCS.mkdir(exist_ok=True)
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "environment-page.png"), full_page=True)

    # Launch a QC run from the page: back on the page with the run listed.
    page.fill("#qc-repeats", "1")
    page.click("#launch-qc-button")
    page.wait_for_selector(".messages >> text=queued for sums v1")
    qc = Run.objects.get(kind="qc")
    assert qc.config["qc"]["repeats"] == 1
    assert page.locator(f'#version-runs tr[data-run="{qc.pk}"]').count() == 1
