"""An eval suite's leaderboard in a real browser: a viewer reaches it from the team nav and
sees three checkpoints of a suite-gated run (evaluated through the real worker API, the
hooks firing on real commits) ranked by capability, their cost and latency, the Pareto
front marked, the regressed checkpoint's verdict; re-ranks by cost; no console error."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.evals import services as eval_services
from apps.teams.models import Role
from apps.teams.services import worker_token_create
from tests.apps.evals.flow import checkpoint, eval_runs, finish_eval, start
from tests.browser.test_dashboard import no_sideways_scroll, screenshot
from tests.browser.test_run_charts import login
from tests.django_fixtures import client_for_token
from tests.factories import make_lab, make_train_run

pytestmark = pytest.mark.slow
WAIT = 15_000
# step: (pass@1, latency s per sample, seconds the eval run's attempt held, for 4 tasks)
STEPS = {10: (0.75, 0.20, 400.0), 20: (0.50, 0.05, 200.0), 30: (0.70, 0.20, 600.0)}


@pytest.fixture
def lab(transactional_db):
    lab = make_lab(Role.VIEWER)
    project = lab["project"]
    env = env_services.environment_create(actor=Actor.system(), team=lab["team"],
                                          project=project, slug="arith")
    env_services.version_create(actor=Actor.system(), environment=env, spec={
        "env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}})
    eval_services.suite_create(actor=Actor.system(), team=lab["team"], slug="core",
                               project="math", name="Core arithmetic",
                               entries=[{"environment": "arith@v1", "threshold": 0.1}])
    _, raw = worker_token_create(actor=Actor.system(), team=None, name="pool")
    worker = client_for_token(raw)
    run = make_train_run(project, name="grpo", config={"eval_suite": "core"})
    lease = start(worker, run, "gpu")
    lab["evaluations"] = {}
    for step, (score, latency, held) in STEPS.items():
        _, evaluation = checkpoint(worker, run, lease, step)
        (run_id,) = eval_runs(evaluation)
        finish_eval(worker, run_id, pass_at={"1": score}, mean_reward=score,
                    latency_s=latency, held_s=held, tasks=4)
        lab["evaluations"][step] = evaluation.pk
    return lab


def rows(page) -> list[dict[str, str]]:
    out = []
    for row in page.locator("#leaderboard tbody tr").all():
        out.append({k: row.locator(f".{k}").inner_text().strip()
                    for k in ("rank", "subject", "capability", "gpu", "cpu", "latency",
                              "pareto")})
    return out


def test_viewer_reads_the_leaderboard(asgi_server, lab, browser):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header nav a:text('Evals')")
    page.wait_for_url(f"{asgi_server}/t/lab/evals/")
    assert "core" in page.locator("main").inner_text(), page.content()[:3000]
    page.click('#suites a[href="/t/lab/evals/core/"]')
    page.wait_for_url(f"{asgi_server}/t/lab/evals/core/")
    assert "Eval suite core" in page.locator("h1").inner_text()
    assert "arith@v1" in page.locator("#entries").inner_text()

    board = rows(page)
    assert [(r["rank"], r["subject"].split(" checkpoint")[0], r["capability"], r["latency"])
            for r in board] == [("1", "grpo @ step 10", "0.750", "0.2000"),
                                ("2", "grpo @ step 30", "0.700", "0.2000"),
                                ("3", "grpo @ step 20", "0.500", "0.0500")]
    # CPU-seconds per task: the held seconds (one core) over 4 tasks, plus the moments the
    # test's own requests took between claim and finish.
    cpu = [float(r["cpu"]) for r in board]
    assert cpu == pytest.approx([100.0, 150.0, 50.0], abs=2.0)
    assert [r["gpu"] for r in board] == ["0.000"] * 3  # a CPU pool: no GPU-seconds
    # Step 30 is no better than step 10 on anything: off the front. Step 20 is the fastest
    # and cheapest: on it, with step 10 (the most capable).
    assert [r["pareto"] for r in board] == ["★ front", "dominated", "★ front"]

    verdicts = {page.locator(f'#evaluations tr[data-evaluation="{pk}"] .verdict').inner_text()
                for pk in lab["evaluations"].values()}
    assert verdicts == {"passed", "regressed"}
    regressed = page.locator(
        f'#evaluations tr[data-evaluation="{lab["evaluations"][20]}"]')
    assert regressed.locator(".verdict").inner_text() == "regressed"
    assert "prev -0.250" in regressed.inner_text() and "regression" in regressed.inner_text()
    screenshot(page, "evals-leaderboard.png")
    no_sideways_scroll(page)

    page.click("a:text('cost')")
    page.wait_for_url(f"{asgi_server}/t/lab/evals/core/?order=cost")
    assert [r["subject"].split(" checkpoint")[0] for r in rows(page)] == [
        "grpo @ step 20", "grpo @ step 10", "grpo @ step 30"]
    assert errors == []

