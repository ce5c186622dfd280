"""Server-rendered dataset and review pages (Django test client; the browser tests drive the
same pages with the keyboard), the lineage SVG and the manifest presenter."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from apps.core.actor import Actor
from apps.datasets import lineage_svg
from apps.datasets.manifests import present
from apps.review import services as review_services
from tests.factories import DatasetFactory, make_run, make_version


def _session(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


MANIFEST = {
    "config": {"name": "math-mix"}, "seed": 3,
    "stages": {"syntax": {"in": 10, "out": 9}, "logic": {"in": 9, "out": 8}},
    "rejections": {"logic.answer_mismatch": 1}, "distinct_n": {"1": 0.5, "2": 0.9},
}


@pytest.fixture
def qa(project, member):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    v1 = make_version(dataset, [{"id": 1, "q": "a"}, {"id": 2, "q": "b"}])
    dataset.refresh_from_db()
    run = make_run(project, dataset, name="synth-run-x")
    batch = review_services.batch_create(
        actor=Actor.of_user(member.user), dataset=dataset, run=run, manifest=MANIFEST,
        records=[{"id": 1, "q": "a"}, {"id": 2, "q": "B"}, {"id": 3, "q": "c"}],
        target_error_rate=0.5, confidence=0.9, sample_seed=1, name="batch-one",
    )
    for item in batch.items.all():
        review_services.verdict(actor=Actor.of_user(member.user), item=item, verdict="accept")
    batch.refresh_from_db()
    dataset.refresh_from_db()
    return dataset, v1, batch.version, run


def test_datasets_list_page(viewer, qa):
    html = _session(viewer).get("/t/acme/datasets/").content.decode()
    assert 'href="/t/acme/datasets/qa/"' in html and "v2" in html


def test_dataset_page_shows_versions_manifest_diff_and_lineage(viewer, qa):
    dataset, v1, v2, run = qa
    response = _session(viewer).get("/t/acme/datasets/qa/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="v1"' in html and 'id="v2"' in html and "current: v2" in html
    assert "Stage statistics" in html and "logic.answer_mismatch" in html
    assert "math-mix" in html
    # default diff: v1 -> v2
    assert "+1 added" in html and "~1 changed" in html
    # lineage SVG: the run produced v2, v1 is not linked to it (no parents given)
    svg = re.search(r"<svg[^>]*lineage-graph.*?</svg>", html, re.S).group(0)
    assert f'data-id="{run.pk}"' in svg and f'data-id="{v2.digest}"' in svg
    assert 'data-relation="produced"' in svg
    assert "batch-one" in html and "Roll back to v1" not in html  # viewers cannot


def test_diff_partial_for_htmx(viewer, qa):
    client = _session(viewer)
    partial = client.get("/t/acme/datasets/qa/diff/?a=v2&b=v1&key=", HTTP_HX_REQUEST="true")
    html = partial.content.decode()
    assert partial.status_code == 200 and "<html" not in html
    assert "matched by content" in html and "−2 removed" in html
    assert client.get("/t/acme/datasets/qa/diff/?a=v9").status_code == 404


def test_rollback_confirmation_then_post(member, viewer, qa):
    dataset, v1, v2, _ = qa
    client = _session(member)
    page = client.get("/t/acme/datasets/qa/").content.decode()
    assert "/t/acme/datasets/qa/rollback/?to=v1" in page
    confirm = client.get("/t/acme/datasets/qa/rollback/?to=v1").content.decode()
    assert "Make <strong>v1</strong>" in confirm and 'id="confirm-rollback"' in confirm
    denied = _session(viewer).post("/t/acme/datasets/qa/rollback/", {"to": "v1"})
    assert denied.status_code == 403
    dataset.refresh_from_db()
    assert dataset.current_version == v2
    done = client.post("/t/acme/datasets/qa/rollback/", {"to": "v1", "reason": "regression"})
    assert done.status_code == 302 and done["Location"] == "/t/acme/datasets/qa/"
    dataset.refresh_from_db()
    assert dataset.current_version == v1
    page = client.get("/t/acme/datasets/qa/").content.decode()
    assert "Rolled back qa from v2 to v1" in page and "regression" in page
    forward = client.post("/t/acme/datasets/qa/rollback/", {"to": "v2"})
    assert forward.status_code == 400 and "newer than the current" in forward.content.decode()


def test_review_queue_page_and_partial(member, project):
    dataset = DatasetFactory(project=project, team=project.team, slug="synth")
    batch = review_services.batch_create(
        actor=Actor.of_user(member.user), dataset=dataset, manifest=MANIFEST,
        records=[{"id": i, "q": f"item-{i}", "verification": [
            {"stage": "logic", "ok": True, "check": "rederive", "detail": "ok"}]}
            for i in range(10)],
        target_error_rate=0.5, confidence=0.9, sample_seed=2, name="queue-batch")
    first = batch.items.order_by("id").first()
    review_services.verdict(actor=Actor.of_user(member.user), item=first, verdict="reject",
                            reason="ambiguous wording")
    client = _session(member)
    html = client.get("/t/acme/review/").content.decode()
    assert "queue-batch" in html and html.count('role="option"') == 4
    assert "ambiguous wording" in html and "rederive" in html
    assert 'id="accept-btn"' in html and "1 of 4 reviewed" in html
    partial = client.get(f"/t/acme/review/?batch={batch.pk}", HTTP_HX_REQUEST="true")
    assert partial.status_code == 200 and "<html" not in partial.content.decode()
    assert client.get("/t/acme/review/?batch=not-a-uuid").status_code == 404


def test_lineage_svg_layout_and_escaping():
    a, run, b = ("dataset_version", "d1"), ("run", "r1"), ("dataset_version", "d2")
    nodes = [lineage_svg.Node(b, "qa v2", current=True), lineage_svg.Node(run, "<run & co>"),
             lineage_svg.Node(a, "qa v1", href="/x?a=1&b=2")]
    edges = [lineage_svg.Edge(a, run, "input"), lineage_svg.Edge(run, b, "produced")]
    assert lineage_svg.layers(nodes, edges) == {a: 0, run: 1, b: 2}
    at = lineage_svg.positions(nodes, edges)
    assert at[a][0] < at[run][0] < at[b][0] and at[a][1] == at[b][1]
    svg = lineage_svg.render(nodes, edges, title="Lineage")
    assert svg.startswith("<svg") and svg.count('class="edge"') == 2
    assert "&lt;run &amp; co&gt;" in svg and 'href="/x?a=1&amp;b=2"' in svg
    assert 'class="node current"' in svg
    assert lineage_svg.render([], [], title="x") == ""


def test_manifest_presenter_reads_known_shapes_and_never_fails():
    view = present(MANIFEST)
    assert ("generator", "math-mix") in view.facts and ("seed", 3) in view.facts
    assert view.stages.headers == ["", "in", "out"]
    assert view.stages.rows == [["syntax", 10, 9], ["logic", 9, 8]]
    assert view.distinct_n == [("1", 0.5), ("2", 0.9)]
    listed = present({"stage_stats": [{"stage": "syntax", "kept": 3}], "odd": object()})
    assert listed.stages.headers == ["stage", "kept"] and "odd" in listed.raw
    assert present(None).empty and present({}).stages is None
