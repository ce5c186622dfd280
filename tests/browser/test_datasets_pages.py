"""Dataset pages in a real browser: compare two versions (htmx diff), read the lineage graph,
and roll the dataset back to an earlier version through the confirmation page."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.core.actor import Actor
from apps.core.models import AuditLog
from apps.review import services as review_services
from apps.teams.models import Role
from tests.factories import (
    DatasetFactory,
    MembershipFactory,
    ProjectFactory,
    TeamFactory,
    UserFactory,
    make_run,
    make_version,
)

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
PASSWORD = "pw-for-tests-1"
WAIT = 10_000

V1 = [{"id": 1, "question": "1 + 1", "answer": "2"}, {"id": 2, "question": "2 + 2", "answer": "4"}]
V2 = [{"id": 1, "question": "1 + 1", "answer": "2"}, {"id": 2, "question": "2 + 2", "answer": "5"},
      {"id": 3, "question": "3 + 3", "answer": "6"}]


def login(browser, server: str, username: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{server}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/t/**")
    return page


def test_compare_versions_and_roll_back(asgi_server, browser):
    user = UserFactory(username="dana")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    dataset = DatasetFactory(project=project, team=team, slug="gsm-synth")
    make_version(dataset, V1)
    make_version(dataset, V2)
    dataset.refresh_from_db()
    run = make_run(project, dataset, name="synthesize-gsm")
    batch = review_services.batch_create(
        actor=Actor.of_user(user), dataset=dataset, run=run, name="gsm-batch-3",
        records=[*V2, {"id": 4, "question": "4 + 4", "answer": "8"}],
        manifest={"config": {"name": "gsm-mix"}, "seed": 7,
                  "stages": {"syntax": {"in": 5, "out": 4}, "logic": {"in": 4, "out": 4}},
                  "distinct_n": {"1": 0.52, "2": 0.81}},
        target_error_rate=0.5, confidence=0.9, sample_seed=3,
    )
    for item in batch.items.all():
        review_services.verdict(actor=Actor.of_user(user), item=item, verdict="accept")

    page = login(browser, asgi_server, "dana")
    page.click("nav.tabs >> text=Datasets")
    page.wait_for_url("**/t/lab/datasets/")
    page.click("text=gsm-synth")
    page.wait_for_url("**/t/lab/datasets/gsm-synth/")
    assert page.inner_text("#current-version") == "current: v3"
    assert page.locator("table.stage-stats").first.is_visible()  # newest manifest is open
    # The lineage graph, drawn on the server: the run produced v3.
    assert page.locator(f'svg.lineage-graph [data-id="{run.pk}"]').count() == 1
    assert page.locator('svg.lineage-graph g.edge[data-relation="produced"]').count() == 1

    # Diff v1 -> v3 with htmx, no reload.
    page.evaluate("window.__noReload = true")
    page.select_option("#diff-a", "v1")
    page.select_option("#diff-b", "v3")
    page.click(".diff-form button[type=submit]")
    page.wait_for_selector("#diff:has-text('From v1 to v3')", timeout=WAIT)
    assert page.inner_text('[data-count="added"]') == "+2 added"
    assert page.inner_text('[data-count="changed"]') == "~1 changed"
    assert page.evaluate("window.__noReload") is True

    # Roll back to v1, confirming on the way.
    page.click("tr#v1 >> text=Roll back to v1")
    page.wait_for_url("**/rollback/?to=v1")
    assert "instead of v3" in page.inner_text("#rollback-question")
    page.fill("#rollback-reason", "v2 introduced a wrong answer")
    page.click("#confirm-rollback")
    page.wait_for_url("**/t/lab/datasets/gsm-synth/")
    assert page.inner_text("#current-version") == "current: v1"
    assert "Rolled back gsm-synth from v3 to v1" in page.inner_text(".messages")
    assert "v2 introduced a wrong answer" in page.inner_text("ol.history")
    dataset.refresh_from_db()
    assert dataset.current_version.number == 1
    assert AuditLog.objects.get(action="dataset.rollback").actor == user

    page.set_viewport_size({"width": 800, "height": 900})
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"dataset page is {overflow}px too wide at 800px"
    page.set_viewport_size({"width": 1280, "height": 900})
    DOCS.mkdir(exist_ok=True)
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "dataset-page.png"), full_page=True)


def test_record_browser_upload_diff_explanation_and_lineage_fit(asgi_server, browser,
                                                                tmp_path):
    from tests.browser.test_run_charts import watch_console

    user = UserFactory(username="erin")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    dataset = DatasetFactory(project=project, team=team, slug="arith")
    # Like the demo data: ids repeat, so "id" cannot pair records.
    rows = [{"id": i % 40, "question": f"{i} + {i}", "answer": str(2 * i),
             "meta": {"difficulty": i % 3}} for i in range(50)]
    make_version(dataset, rows)
    dataset.refresh_from_db()
    run = make_run(project, dataset, name="profile-arith")  # a lineage edge to draw
    page = login(browser, asgi_server, "erin")
    errors = watch_console(page)
    page.goto(f"{asgi_server}/t/lab/datasets/arith/")

    # Records: paged, a column per field, searchable in one field.
    page.wait_for_selector("#records-table", timeout=WAIT)
    heads = page.locator("#records-table thead th").all_inner_texts()
    assert heads[1:] == ["id", "answer", "meta", "question"]  # ids first
    assert page.locator("#records-table tbody tr").count() == 25
    assert "Page 1 of 2" in page.inner_text("#records")
    page.click("#records a[rel=next]")
    page.wait_for_selector("#records:has-text('Page 2 of 2')", timeout=WAIT)
    assert page.locator("#records-table tbody tr").count() == 25
    page.fill("#rec-q", "98")
    page.wait_for_selector("#records-count:has-text('match')", timeout=WAIT)
    page.select_option("#rec-field", "answer")
    page.wait_for_selector("#records-count:has-text('in answer')", timeout=WAIT)
    assert page.inner_text("#records-count").startswith("1 of 50 records match “98” in answer")
    assert page.locator("#records-table tbody tr td").nth(4).inner_text() == "49 + 49"

    # Upload a new version from the page: one answer changed, one record added.
    changed = [dict(r) for r in rows] + [{"id": 99, "question": "x", "answer": "y",
                                         "meta": {}}]
    changed[3]["answer"] = "wrong"
    path = tmp_path / "v2.jsonl"
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in changed))
    page.set_input_files("#upload-file", str(path))
    page.fill("#upload-message", "fix from the UI")
    page.click(".upload-form button[type=submit]")
    page.wait_for_selector(".messages:has-text('as v2 (51 records)')", timeout=WAIT)
    assert page.inner_text("#current-version") == "current: v2"
    # The diff says how records were matched, and why not by id.
    page.wait_for_selector("#diff-match", timeout=WAIT)
    match = page.inner_text("#diff-match")
    assert "matched by content, not by id" in match and "repeat an earlier id" in match
    assert page.inner_text('[data-count="added"]') == "+2 added"
    # A bad file is refused with the reason, and nothing is stored.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\nnot json\n')
    page.set_input_files("#upload-file", str(bad))
    page.click(".upload-form button[type=submit]")
    page.wait_for_selector(".messages .msg-error", timeout=WAIT)
    assert "bad.jsonl" in page.inner_text(".messages")
    dataset.refresh_from_db()
    assert dataset.versions.count() == 2

    # The lineage graph fits its box at 800 px.
    page.set_viewport_size({"width": 800, "height": 900})
    assert page.locator(f'svg.lineage-graph [data-id="{run.pk}"]').count() == 1
    fits = page.evaluate("""() => { const svg = document.querySelector('svg.lineage-graph');
        const box = svg.parentElement; return svg.getBoundingClientRect().width
        <= box.clientWidth + 1 && box.scrollWidth <= box.clientWidth + 1; }""")
    assert fits
    assert page.evaluate("document.documentElement.scrollWidth - window.innerWidth") <= 0
    assert errors == []
