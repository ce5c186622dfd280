"""Run tags end to end: launch with tags (API and form), refusals naming ``tags``, the
``?tag=`` filter on the API list and the runs table (full page and htmx partial), team
isolation, clone, and a runs-table query count that stays flat with tags."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.runs.models import Run, RunEvent, RunStatus, RunTag
from tests.factories import DatasetFactory, ProjectFactory, make_version

RUNS = "/api/v1/teams/acme/runs"
PAGE = "/t/acme/"


def _dataset(project, slug: str = "qa"):
    dataset = DatasetFactory(project=project, team=project.team, slug=slug)
    make_version(dataset, [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)])
    return dataset


@pytest.fixture
def qa(project):
    return _dataset(project)


def launch(client, url: str = RUNS, **overrides):
    body = {"project": "main", "kind": "profile", "datasets": ["qa"], "config": {}, **overrides}
    return client.post(url, body, format="json")


def browser_for(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


def listed(client, query: str) -> list[str]:
    r = client.get(f"{RUNS}?{query}")
    assert r.status_code == 200, r.content
    return sorted(row["name"] for row in r.json()["results"])


def test_launch_freezes_tags_and_the_api_filters_by_them(member, qa):
    r = launch(member.client, name="a", tags=["baseline", "lr-1e-3", "baseline", "v2.1"])
    assert r.status_code == 201, r.content
    assert r.json()["tags"] == ["baseline", "lr-1e-3", "v2.1"]  # each once, order kept
    run = Run.objects.get(pk=r.json()["id"])
    assert run.tags == ["baseline", "lr-1e-3", "v2.1"]
    assert sorted(RunTag.objects.filter(run=run).values_list("tag", flat=True)) == [
        "baseline", "lr-1e-3", "v2.1"]
    queued = RunEvent.objects.get(run=run, kind="status")
    assert queued.data["document"]["tags"] == ["baseline", "lr-1e-3", "v2.1"]
    assert launch(member.client, name="b", tags=["lr-1e-3"]).status_code == 201
    assert launch(member.client, name="c").json()["tags"] == []
    preview = launch(member.client, f"{RUNS}/preview", tags=["x"])
    assert preview.json()["run"]["tags"] == ["x"]

    assert member.client.get(f"{RUNS}/{run.pk}").json()["tags"] == run.tags
    assert listed(member.client, "tag=lr-1e-3") == ["a", "b"]
    assert listed(member.client, "tag=baseline") == ["a"]
    assert listed(member.client, "tag=lr-1e-3&tag=v2.1") == ["a"]  # repeated: all of them
    assert listed(member.client, "tag=LR-1E-3") == []  # tags are case-sensitive
    assert listed(member.client, "tag=nobody") == []
    assert listed(member.client, "") == ["a", "b", "c"]
    bad = member.client.get(f"{RUNS}?tag=not%20a%20tag")
    assert bad.status_code == 400 and "tag" in bad.json()["errors"]


@pytest.mark.parametrize(("tags", "needle"), [
    (["ok", ""], "''"),
    (["has space"], "'has space'"),
    (["x" * 41], "1 to 40"),
    (["sl/ash"], "sl/ash"),
    ([f"t{i}" for i in range(17)], "at most 16"),
    ("baseline", "tags"),
    ([1.5, {"a": 1}], "tags"),
])
def test_bad_tags_are_400_naming_tags_and_create_nothing(member, qa, tags, needle):
    for url in (RUNS, f"{RUNS}/preview"):
        r = launch(member.client, url, tags=tags)
        assert r.status_code == 400, (url, r.content)
        body = r.json()
        assert "tags" in body["errors"], body
        assert needle in body["message"] or needle in str(body["errors"]), body
    assert not Run.objects.exists() and not RunTag.objects.exists()


def test_tags_stay_inside_their_team(member, outsider, qa, other_team):
    _dataset(ProjectFactory(team=other_team, slug="main"))
    theirs = launch(outsider.client, "/api/v1/teams/rival/runs", name="theirs",
                    tags=["shared", "secret-rival"])
    assert theirs.status_code == 201, theirs.content
    assert launch(member.client, name="ours", tags=["shared"]).status_code == 201
    assert listed(member.client, "tag=shared") == ["ours"]
    assert listed(member.client, "tag=secret-rival") == []
    html = browser_for(member).get(PAGE).content.decode()
    assert "secret-rival" not in html
    assert re.findall(r'<option value="([^"]+)"', html.split('id="f-tag"')[1].split("</select>")[0]
                      ) == ["shared"]
    assert browser_for(member).get(PAGE + "?tag=secret-rival").content.decode().count(
        "theirs") == 0


def test_runs_table_filters_by_tag_on_full_page_and_htmx(member, qa):
    for name, tags in (("alpha", ["exp-1", "keep"]), ("beta", ["exp-1"]), ("gamma", [])):
        assert launch(member.client, name=name, tags=tags).status_code == 201
    client = browser_for(member)

    def names(html: str) -> list[str]:
        return sorted(re.findall(r'title="(alpha|beta|gamma)">', html))

    full = client.get(PAGE + "?tag=exp-1").content.decode()
    assert names(full) == ["alpha", "beta"]
    assert '<option value="exp-1" selected>' in full  # the control beside the others
    assert re.search(r'class="chip tag current"[^>]*>exp-1</a>', full)
    partial = client.get(PAGE + "?tag=keep&sort=name", HTTP_HX_REQUEST="true",
                         HTTP_HX_TARGET="runs").content.decode()
    assert "<html" not in partial and names(partial) == ["alpha"]
    # A chip link keeps the other filters and sets only the tag.
    assert 'href="?sort=name&amp;tag=exp-1"' in partial
    assert names(client.get(PAGE + "?tag=a%20b").content.decode()) == [
        "alpha", "beta", "gamma"]  # not a tag: ignored, like other stale filters
    assert "No runs match these filters" in client.get(PAGE + "?tag=nothing").content.decode()


def test_launch_form_takes_tags_and_clone_copies_them(member, qa):
    client = browser_for(member)
    form = {"project": "main", "kind": "profile", "name": "p1", "datasets": ["qa"],
            "environment": "", "pool": "", "priority": "0", "config": "{}",
            "tags": "nightly, ablation  lr-3", "action": "launch"}
    bad = client.post("/t/acme/launch/", {**form, "tags": "good, b@d"})
    assert bad.status_code == 400
    assert re.search(r'id="err_tags".*b@d', bad.content.decode(), re.S)
    assert not Run.objects.exists()
    response = client.post("/t/acme/launch/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    run = Run.objects.get()
    assert run.tags == ["nightly", "ablation", "lr-3"]
    page = client.get(f"/t/acme/runs/{run.pk}/").content.decode()
    assert re.search(r'href="/t/acme/\?tag=ablation"[^>]*>ablation</a>', page)
    clone = client.get(f"/t/acme/launch/?clone={run.pk}").content.decode()
    assert re.search(r'name="tags"[^>]*value="nightly, ablation, lr-3"', clone)


def _queries(client: Client, url: str, **headers: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url, **headers)
    assert response.status_code == 200
    return len(ctx.captured_queries)


def _tagged_runs(project, n: int, start: int, user) -> None:
    runs = Run.objects.bulk_create(
        Run(team=project.team, project=project, name=f"t-{start + i:05d}", kind="profile",
            status=RunStatus.QUEUED, config={}, pool="cpu", created_by=user,
            tags=[f"g{(start + i) % 7}", "all"])
        for i in range(n))
    RunTag.objects.bulk_create(
        RunTag(run=r, team=project.team, tag=t) for r in runs for t in r.tags)


def test_runs_table_query_count_is_constant_with_tags(member, project):
    client = browser_for(member)
    urls = [PAGE, PAGE + "?tag=all&sort=name", PAGE + "?tag=g3"]
    hx = {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "runs"}
    _tagged_runs(project, 10, 0, member.user)
    few = [_queries(client, u) for u in urls] + [_queries(client, urls[1], **hx)]
    _tagged_runs(project, 290, 10, member.user)
    many = [_queries(client, u) for u in urls] + [_queries(client, urls[1] + "&page=3", **hx)]
    assert many == few
    html = client.get(PAGE + "?tag=g3").content.decode()
    assert ">43 runs</p>" in html  # i % 7 == 3 for 43 of 0..299
