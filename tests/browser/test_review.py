"""The review queue in a real browser, driven by the keyboard only: one batch accepted by
spot-check (a, a, a, a) and becoming a dataset version, one rejected (r, reason, Enter),
with j/k moving the focus and another reviewer's lock respected."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.review import services as review_services
from apps.review.models import Batch, ReviewItem
from apps.teams.models import Role
from tests.factories import (
    DatasetFactory,
    MembershipFactory,
    ProjectFactory,
    TeamFactory,
    UserFactory,
)

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
PASSWORD = "pw-for-tests-1"
WAIT = 10_000


def records(tag: str) -> list[dict]:
    return [{"id": i, "question": f"{tag}: what is {i} * 3?", "answer": str(3 * i),
             "verification": [{"stage": "syntax", "ok": True, "check": "parses"},
                              {"stage": "logic", "ok": True, "check": "rederive",
                               "detail": f"{3 * i} == {3 * i}"}]} for i in range(10)]


def eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def open_count(page) -> int:
    return page.locator('#items [data-status="open"]').count()


def wait_open(page, n: int) -> None:
    page.wait_for_function(
        f"() => document.querySelectorAll('#items [data-status=\"open\"]').length === {n}",
        timeout=WAIT)


def selected(page) -> str:
    return page.get_attribute('#items [aria-selected="true"]', "data-item")


def test_accept_and_reject_batches_with_the_keyboard(asgi_server, browser):
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=alice, role=Role.MEMBER)
    MembershipFactory(team=team, user=bob, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    dataset = DatasetFactory(project=project, team=team, slug="synth-math")
    plan = {"target_error_rate": 0.5, "confidence": 0.9}  # a 4-record sample of 10
    good = review_services.batch_create(
        actor=Actor.system(), dataset=dataset, records=records("good"), name="good-batch",
        manifest={"stages": {"syntax": {"in": 12, "out": 10}}}, sample_seed=1, **plan)
    bad = review_services.batch_create(
        actor=Actor.system(), dataset=dataset, records=records("bad"), name="bad-batch",
        sample_seed=2, **plan)
    # bob holds one of the good batch's items.
    held = good.items.order_by("id").last()
    review_services.claim(actor=Actor.of_user(bob), item=held)

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{asgi_server}/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{asgi_server}/t/**")
    page.click("nav.tabs >> text=Review")
    page.wait_for_url("**/t/lab/review/")
    assert page.locator(".batch-panel").count() == 2

    page.goto(f"{asgi_server}/t/lab/review/?batch={good.pk}")
    lock = page.locator(f"#item-{held.pk}")
    assert "🔒 bob" in lock.inner_text()
    first = selected(page)
    assert first and first != str(held.pk)
    # The focused item is claimed by alice.
    eventually(lambda: ReviewItem.objects.get(pk=first).locked_by_id == alice.pk)
    assert page.evaluate("document.activeElement.dataset.item") == first

    # j / k move the selection and the focus.
    page.keyboard.press("j")
    second = selected(page)
    assert second != first and page.evaluate("document.activeElement.dataset.item") == second
    assert page.is_visible(f"#detail-{second}") and not page.is_visible(f"#detail-{first}")
    page.keyboard.press("k")
    assert selected(page) == first
    assert "rederive" in page.inner_text(f"#detail-{first}")  # the verification trail

    # Accept the three items alice may judge; bob's lock keeps the fourth away from her.
    for left in (2, 1, 0):
        page.keyboard.press("a")
        wait_open(page, left + 1)  # bob's item stays open
    assert ReviewItem.objects.get(pk=held.pk).status == "open"
    page.keyboard.press("a")  # only bob's item is open: nothing alice may judge
    assert open_count(page) == 1 and ReviewItem.objects.get(pk=held.pk).status == "open"

    # bob's lock expires; alice can finish, and the batch is accepted.
    ReviewItem.objects.filter(pk=held.pk).update(
        lock_expires_at=timezone.now() - timedelta(seconds=1))
    page.reload()
    assert selected(page) == str(held.pk)
    page.keyboard.press("a")
    page.wait_for_selector(f'[data-batch-status="{good.pk}"]:has-text("Accepted")',
                           timeout=WAIT)
    good.refresh_from_db()
    assert good.status == "accepted" and good.version.record_count == 10
    assert good.version.manifest["stages"]["syntax"]["out"] == 10

    # The bad batch. Escape cancels a rejection and gives the focus back to the list.
    page.goto(f"{asgi_server}/t/lab/review/?batch={bad.pk}")
    page.keyboard.press("r")
    page.wait_for_selector("#reject-reason:focus", timeout=WAIT)
    page.keyboard.type("on second thought")
    page.keyboard.press("Escape")
    assert page.is_hidden("#reject-form") and open_count(page) == 4
    assert page.evaluate("document.activeElement.dataset.item") == selected(page)
    # r, a reason, Enter, four times; rejected items keep their reason.
    for n in range(4):
        page.keyboard.press("r")
        page.wait_for_selector("#reject-reason:focus", timeout=WAIT)
        page.keyboard.type(f"answer does not match question {n}")
        page.keyboard.press("Enter")
        wait_open(page, 3 - n)
    page.wait_for_selector(f'[data-batch-status="{bad.pk}"]:has-text("Rejected")',
                           timeout=WAIT)
    reasons = page.locator("#items q.reason").all_inner_texts()
    assert sorted(reasons) == [f"answer does not match question {n}" for n in range(4)]
    assert "above 50.0%" in page.inner_text(".batch-panel .decision")
    bad.refresh_from_db()
    assert bad.status == "rejected" and bad.version is None
    assert Batch.objects.filter(dataset=dataset, status="accepted").count() == 1

    page.set_viewport_size({"width": 800, "height": 900})
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"review page is {overflow}px too wide at 800px"
    page.set_viewport_size({"width": 1280, "height": 900})
    DOCS.mkdir(exist_ok=True)
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "review-queue.png"), full_page=True)


def test_review_item_reads_as_fields_and_the_last_verdict_can_be_undone(asgi_server, browser):
    from tests.browser.test_run_charts import watch_console

    carol = UserFactory(username="carol")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=carol, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    dataset = DatasetFactory(project=project, team=team, slug="synth-math")
    batch = review_services.batch_create(
        actor=Actor.system(), dataset=dataset, records=records("undo"), name="undo-batch",
        sample_seed=1, target_error_rate=0.5, confidence=0.9)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = watch_console(page)
    page.goto(f"{asgi_server}/accounts/login/")
    page.fill("#id_username", "carol")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{asgi_server}/t/**")
    page.goto(f"{asgi_server}/t/lab/review/?batch={batch.pk}")
    first = selected(page)
    detail = page.locator(f"#detail-{first}")
    # The record reads as labelled fields, question first, not one JSON blob.
    fields = detail.locator(".record-field dt").all_inner_texts()
    assert [f.lower() for f in fields[:2]] == ["question", "answer"]
    assert "what is" in detail.locator('[data-field="question"] dd').inner_text()
    assert page.is_disabled("#undo-btn")
    page.keyboard.press("a")
    wait_open(page, 3)
    assert ReviewItem.objects.get(pk=first).status == "accepted"
    page.keyboard.press("u")
    wait_open(page, 4)
    item = ReviewItem.objects.get(pk=first)
    assert item.status == "open" and item.reviewed_by is None
    assert [t.to_status for t in item.transitions.order_by("id")] == ["accepted", "open"]
    assert "open again" in page.inner_text("#review-status")
    assert selected(page) == first
    assert errors == []
