"""``/api/v1/teams/<team>/evals/suites``: create, list, read, update, delete; entries
validated by the eval run's own schema; a hostile tenant gets 404 everywhere; a train run
may name only a suite its team has."""

from __future__ import annotations

import pytest

from apps.core.models import AuditLog
from apps.evals.models import EvalSuite, SuiteEntry
from apps.runs.models import Run
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db
SUITES = "/api/v1/teams/acme/evals/suites"
ENTRY = {"environment": "arith@v1", "samples_per_task": 2, "k": [1, 2],
         "sampling": {"max_tokens": 6}, "metric": "pass@2", "threshold": 0.1}


def create(client, **overrides):
    body = {"slug": "core", "project": "main", "name": "Core", "entries": [ENTRY],
            **overrides}
    return client.post(SUITES, body, format="json")


def test_create_list_read_update_delete(member, viewer, arith):
    r = create(member.client, entries=[ENTRY, {"environment": "arith@v1",
                                               "metric": "mean_reward"}])
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["slug"] == "core" and body["project"] == "main" and body["baseline"] is None
    first, second = body["entries"]
    assert first["environment"] == "arith@v1" and first["digest"] == arith.digest
    assert first["params"]["samples_per_task"] == 2 and first["params"]["k"] == [1, 2]
    assert first["params"]["split"] == "eval"  # the eval run's defaults are filled in
    assert (first["metric"], first["threshold"]) == ("pass@2", 0.1)
    assert (second["metric"], second["threshold"]) == ("mean_reward", 0.05)  # defaults
    assert AuditLog.objects.filter(action="evals.suite.create", target_id="core").exists()

    listed = viewer.client.get(SUITES).json()
    assert [s["slug"] for s in listed["results"]] == ["core"]
    assert viewer.client.get(f"{SUITES}/core").json()["name"] == "Core"

    r = member.client.patch(f"{SUITES}/core", {"name": "Core tasks", "description": "d"},
                            format="json")
    assert r.status_code == 200 and r.json()["name"] == "Core tasks"
    # entries are frozen: the update refuses them by name
    r = member.client.patch(f"{SUITES}/core", {"entries": [ENTRY]}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"entries": ["unknown field"]}
    assert viewer.client.delete(f"{SUITES}/core").status_code == 403
    assert member.client.delete(f"{SUITES}/core").status_code == 204
    assert not EvalSuite.objects.exists() and not SuiteEntry.objects.exists()


@pytest.mark.parametrize(("entry", "field", "words"), [
    ({"environment": "nope@v1"}, "entries[0].environment", "nope"),
    ({}, "entries[0].environment", "give an environment version"),
    ({"environment": "arith@v1", "k": [3]}, "entries[0].k", "k <= samples_per_task"),
    ({"environment": "arith@v1", "temperature": 1}, "entries[0].temperature", "unknown"),
    ({"environment": "arith@v1", "split": "dev"}, "entries[0].split", ""),
    ({"environment": "arith@v1", "metric": "pass@4"}, "entries[0].metric", "pass@1"),
    ({"environment": "arith@v1", "threshold": 2}, "entries[0].threshold", "from 0 to 1"),
    ({"environment": "arith@v1", "threshold": "x"}, "entries[0].threshold", "from 0 to 1"),
    ("arith@v1", "entries[0]", "object"),
])
def test_bad_entries_are_400_naming_the_field(member, arith, entry, field, words):
    r = create(member.client, entries=[entry])
    assert r.status_code == 400, r.content
    body = r.json()
    assert field in body["errors"], body
    assert words in body["message"]
    assert not EvalSuite.objects.exists()


def test_other_bad_documents(member, arith):
    assert create(member.client, entries=[]).status_code == 400
    assert create(member.client, project="ghost").status_code in (400, 404)
    assert create(member.client, slug="bad slug!").status_code == 400
    assert create(member.client, extra=1).status_code == 400
    assert create(member.client).status_code == 201
    again = create(member.client)
    assert again.status_code == 409 and "already exists" in str(again.json())
    assert member.client.get(f"{SUITES}/core/leaderboard?order=price").status_code == 400
    r = member.client.patch(f"{SUITES}/core", {"baseline": 999}, format="json")
    assert r.status_code == 400 and "no evaluation 999" in str(r.json())


def test_viewer_cannot_create(viewer, arith):
    assert create(viewer.client).status_code == 403


def test_hostile_tenant_gets_404_everywhere(member, outsider, other_team, arith):
    assert create(member.client).status_code == 201
    ckpt_less = [
        ("get", f"{SUITES}"), ("get", f"{SUITES}/core"), ("patch", f"{SUITES}/core"),
        ("delete", f"{SUITES}/core"), ("post", f"{SUITES}/core/evaluate"),
        ("get", f"{SUITES}/core/evaluations"), ("get", f"{SUITES}/core/leaderboard"),
        ("post", SUITES), ("get", "/api/v1/teams/acme/evals/evaluations/1"),
        ("get", "/api/v1/teams/acme/checkpoints/1/gate"),
        ("post", "/api/v1/teams/acme/checkpoints/1/promote"),
    ]
    for method, url in ckpt_less:
        r = getattr(outsider.client, method)(url, {}, format="json")
        assert r.status_code == 404, (method, url, r.status_code)
    # and in their own team, our suite's slug does not exist
    ProjectFactory(team=other_team, slug="main")
    assert outsider.client.get("/api/v1/teams/rival/evals/suites/core").status_code == 404
    assert EvalSuite.objects.get().name == "Core"


def test_a_train_run_may_name_only_its_own_teams_suite(member, outsider, other_team, arith):
    assert create(member.client).status_code == 201
    train = {"project": "main", "kind": "train", "base_model": "preset",
             "config": {"eval_suite": "core"}}
    r = member.client.post("/api/v1/teams/acme/runs", train, format="json")
    assert r.status_code == 201, r.content
    assert Run.objects.get(pk=r.json()["id"]).config["eval_suite"] == "core"
    r = member.client.post("/api/v1/teams/acme/runs", {**train, "config": {
        "eval_suite": "ghost"}}, format="json")
    assert r.status_code == 400 and "config.eval_suite" in r.json()["errors"]
    ProjectFactory(team=other_team, slug="main")
    r = outsider.client.post("/api/v1/teams/rival/runs", train, format="json")
    assert r.status_code == 400 and "no eval suite 'core'" in str(r.json())


def test_pages_list_suites_and_404_an_unknown_one(member, viewer, arith):
    from django.test import Client

    assert create(member.client).status_code == 201
    page = Client()
    page.force_login(viewer.user)
    listing = page.get("/t/acme/evals/")
    assert listing.status_code == 200 and b'href="/t/acme/evals/core/"' in listing.content
    board = page.get("/t/acme/evals/core/")
    assert board.status_code == 200 and b"No complete evaluation yet" in board.content
    assert page.get("/t/acme/evals/nope/").status_code == 404
