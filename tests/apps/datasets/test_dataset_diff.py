"""Diff of two dataset versions and rollback of a dataset's current version."""

from __future__ import annotations

import json

import pytest

from apps.core.models import AuditLog
from apps.datasets.diff import diff_records
from tests.factories import DatasetFactory, make_version

QA = "/api/v1/teams/acme/datasets/qa"

V1 = [{"id": 1, "q": "1+1", "a": "2"}, {"id": 2, "q": "2+2", "a": "4"},
      {"id": 3, "q": "3+3", "a": "6"}]
V2 = [{"id": 1, "q": "1+1", "a": "2"}, {"id": 2, "q": "2+2", "a": "5", "note": "typo"},
      {"id": 4, "q": "4+4", "a": "8"}]


def lines(rows: list[dict]):
    data = [json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in rows]
    return lambda: iter(data)


# --- the pure diff ---------------------------------------------------------------------------


def test_diff_by_key_finds_added_removed_and_changed():
    d = diff_records(lines(V1), lines(V2))
    assert d["mode"] == "key" and d["key"] == "id"
    assert d["counts"] == {"old": 3, "new": 3, "added": 1, "removed": 1, "changed": 1,
                           "unchanged": 1}
    assert d["added"] == [{"id": 4, "q": "4+4", "a": "8"}]
    assert d["removed"] == [{"id": 3, "q": "3+3", "a": "6"}]
    (change,) = d["changed"]
    assert change["key"] == 2 and change["fields"] == ["a", "note"]
    assert change["before"]["a"] == "4" and change["after"]["a"] == "5"
    assert d["truncated"] is False


def test_without_a_usable_key_records_match_by_content():
    old = [{"q": "a"}, {"q": "b"}, {"q": "b"}]
    new = [{"q": "b"}, {"q": "c"}]
    d = diff_records(lines(old), lines(new))
    assert d["mode"] == "content" and d["key"] is None
    assert d["added"] == [{"q": "c"}]
    assert sorted(r["q"] for r in d["removed"]) == ["a", "b"]  # a multiset: one "b" left
    assert d["counts"]["unchanged"] == 1 and d["changed"] == []


def test_duplicate_ids_fall_back_to_the_next_key_then_content():
    old = [{"id": 1, "uid": "x", "v": 1}, {"id": 1, "uid": "y", "v": 2}]
    new = [{"id": 1, "uid": "x", "v": 9}, {"id": 1, "uid": "y", "v": 2}]
    d = diff_records(lines(old), lines(new))
    assert d["mode"] == "key" and d["key"] == "uid"  # "id" repeats; the engine's uid does not
    assert [c["key"] for c in d["changed"]] == ["x"]
    assert diff_records(lines(old), lines(new), keys=("id",))["mode"] == "content"
    assert diff_records(lines(V1), lines(V2), keys=())["mode"] == "content"


def test_diff_against_nothing_and_truncation():
    rows = [{"id": i} for i in range(7)]
    d = diff_records(lambda: iter(()), lines(rows), limit=3)
    assert d["counts"]["added"] == 7 and len(d["added"]) == 3 and d["truncated"] is True
    assert d["added"] == [{"id": 0}, {"id": 1}, {"id": 2}]  # in the version's order


# --- API: diff -------------------------------------------------------------------------------


@pytest.fixture
def qa(project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    v1 = make_version(dataset, V1)
    v2 = make_version(dataset, V2)
    v3 = make_version(dataset, [*V2, {"id": 5, "q": "5+5", "a": "10"}])
    dataset.refresh_from_db()
    return dataset, v1, v2, v3


def test_diff_endpoint_defaults_to_the_previous_version(viewer, qa):
    r = viewer.client.get(f"{QA}/versions/v2/diff")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["base"]["number"] == 1 and body["version"]["number"] == 2
    assert body["counts"]["changed"] == 1 and body["added"][0]["id"] == 4
    first = viewer.client.get(f"{QA}/versions/v1/diff").json()
    assert first["base"] is None and first["counts"]["added"] == 3


def test_diff_endpoint_with_base_key_and_limit(viewer, qa):
    _, v1, _, v3 = qa
    body = viewer.client.get(f"{QA}/versions/{v3.digest}/diff?base=v1&limit=1").json()
    assert body["base"]["digest"] == v1.digest
    assert body["counts"]["added"] == 2 and len(body["added"]) == 1 and body["truncated"]
    by_content = viewer.client.get(f"{QA}/versions/v3/diff?base=v1&key=").json()
    assert by_content["mode"] == "content" and by_content["counts"]["changed"] == 0


@pytest.mark.parametrize(("query", "field"), [("base=v9", "base"), ("limit=0", "limit"),
                                              ("limit=x", "limit")])
def test_diff_endpoint_bad_query_is_400(viewer, qa, query, field):
    r = viewer.client.get(f"{QA}/versions/v2/diff?{query}")
    assert r.status_code == 400 and field in r.json()["errors"]


# --- API: rollback ---------------------------------------------------------------------------


def test_rollback_moves_current_back_and_is_audited(member, qa):
    dataset, v1, _, v3 = qa
    assert dataset.current_version == v3
    r = member.client.post(f"{QA}/rollback", {"version": "v1", "reason": "v2 had a typo"},
                           format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["changed"] is True and body["previous"]["number"] == 3
    assert body["dataset"]["current_version"]["digest"] == v1.digest
    dataset.refresh_from_db()
    assert dataset.current_version == v1
    log = AuditLog.objects.get(action="dataset.rollback")
    assert log.data["from_number"] == 3 and log.data["to_number"] == 1
    assert log.data["reason"] == "v2 had a typo" and log.actor == member.user

    again = member.client.post(f"{QA}/rollback", {"version": v1.digest}, format="json").json()
    assert again["changed"] is False
    assert AuditLog.objects.filter(action="dataset.rollback").count() == 1

    forward = member.client.post(f"{QA}/rollback", {"version": "v2"}, format="json")
    assert forward.status_code == 409 and "current" in forward.json()["message"]
    # Moving forward again is an explicit set of the current version.
    assert member.client.post(f"{QA}/current", {"version": "v3"}).status_code == 200


def test_rollback_errors(member, viewer, qa):
    assert member.client.post(f"{QA}/rollback", {"version": "v9"}).status_code == 404
    assert member.client.post(f"{QA}/rollback", {}).status_code == 400
    assert viewer.client.post(f"{QA}/rollback", {"version": "v1"}).status_code == 403
    assert not AuditLog.objects.filter(action="dataset.rollback").exists()


def test_diff_says_why_it_matched_by_content_when_the_key_repeats():
    """The demo data has duplicate ids: "matched by content" must say so, not replace the key
    silently."""
    old = [{"id": i % 5, "q": f"q{i}"} for i in range(8)]  # ids 0-2 appear twice
    new = [{"id": i % 5, "q": f"q{i}!"} for i in range(8)]
    d = diff_records(lines(old), lines(new), keys=("id",), labels=("v1", "v2"))
    assert d["mode"] == "content"
    assert "not by id" in d["match"]
    assert "3 records of v1 repeat an earlier id (e.g. 0)" in d["match"]
    assert "3 records of v2 repeat an earlier id" in d["match"]
    missing = diff_records(lines([{"q": 1}, {"id": 1}]), lines([{"id": 1}]), keys=("id",),
                           labels=("v1", "v2"))
    assert "1 record of v1 has no id (the first is record 1)" in missing["match"]
    keyed = diff_records(lines(V1), lines(V2))
    assert keyed["match"].startswith("Records were matched by id")
