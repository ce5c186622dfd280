"""Datasets and their content-addressed, immutable versions; environments and theirs."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import DatabaseError, transaction

from apps.datasets.models import Dataset, DatasetVersion
from apps.environments.models import EnvironmentVersion
from apps.lineage.models import LineageEdge
from tests.factories import DatasetFactory, make_version

DATASETS = "/api/v1/teams/acme/datasets"
QA = f"{DATASETS}/qa"
VERSIONS = f"{QA}/versions"

RECORDS = [
    {"prompt": "What is 2+2?", "answer": "4", "id": 1},
    {"prompt": "Capital of France?", "answer": "Paris", "id": 2},
    {"prompt": "Café ✓", "answer": None, "id": 3, "tags": ["x", "y"]},
]


def canonical_digest(records: list) -> str:
    """SHA-256 of canonical JSONL, computed independently of apps.datasets.records."""
    text = "".join(
        json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
        for r in records
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture
def qa(project):
    return DatasetFactory(project=project, team=project.team, slug="qa")


def upload(client, records, **extra):
    return client.post(VERSIONS, {"records": records, **extra}, format="json")


def upload_file(client, content: bytes, headers=None, **fields):
    body = {"file": SimpleUploadedFile("data.jsonl", content, "application/jsonl"), **fields}
    return client.post(VERSIONS, body, format="multipart", **(headers or {}))


# --- datasets --------------------------------------------------------------------------------


def test_create_dataset(member, project):
    r = member.client.post(DATASETS, {"slug": "qa", "project": "main", "description": "d"})
    assert r.status_code == 201, r.content
    assert r.json()["slug"] == "qa"
    assert r.json()["project"] == "main"
    assert r.json()["current_version"] is None
    dataset = Dataset.objects.get(slug="qa")
    assert dataset.team.slug == "acme" and dataset.created_by == member.user

    listed = member.client.get(DATASETS).json()["results"]
    assert [d["slug"] for d in listed] == ["qa"]


def test_create_dataset_unknown_project_is_400_naming_project(member, project):
    r = member.client.post(DATASETS, {"slug": "qa", "project": "nope"})
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "invalid"
    assert "nope" in body["message"] and "project" in body["message"]
    assert "project" in body["errors"]
    assert not Dataset.objects.exists()


def test_create_dataset_duplicate_slug_is_409(member, qa):
    r = member.client.post(DATASETS, {"slug": "qa", "project": "main"})
    assert r.status_code == 409
    assert r.json()["code"] == "conflict"
    assert "qa" in r.json()["message"]
    assert Dataset.objects.filter(slug="qa").count() == 1


def test_viewer_cannot_create_dataset_and_outsider_sees_404(viewer, outsider, project, qa):
    r = viewer.client.post(DATASETS, {"slug": "other", "project": "main"})
    assert r.status_code == 403 and r.json()["code"] == "forbidden"
    assert outsider.client.get(QA).status_code == 404
    assert outsider.client.get(DATASETS).json()["code"] == "not_found"


# --- uploading versions ----------------------------------------------------------------------


def test_upload_json_records_digest_is_sha256_of_canonical_jsonl(member, qa):
    r = upload(member.client, RECORDS, message="first")
    assert r.status_code == 201, r.content
    body = r.json()
    expected = canonical_digest(RECORDS)
    assert body["digest"] == expected
    assert body["number"] == 1
    assert body["record_count"] == 3
    assert body["message"] == "first"
    assert body["dataset"] == "qa"
    canonical_size = sum(
        len((json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n")
            .encode()) for r in RECORDS
    )
    assert body["size_bytes"] == canonical_size
    version = DatasetVersion.objects.get(digest=expected)
    assert version.record_count == 3 and version.created_by == member.user


def test_stored_object_is_the_canonical_jsonl(member, qa, object_store):
    body = upload(member.client, RECORDS).json()
    stored = object_store.get_bytes(body["uri"])
    assert hashlib.sha256(stored).hexdigest() == body["digest"]
    assert stored.decode().splitlines()[2] == (
        '{"answer":null,"id":3,"prompt":"Café ✓","tags":["x","y"]}'
    )


def test_upload_multipart_jsonl_file(member, qa):
    content = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
    r = upload_file(member.client, content, message="from file")
    assert r.status_code == 201, r.content
    assert r.json()["digest"] == canonical_digest(RECORDS)
    assert r.json()["record_count"] == 3
    assert r.json()["message"] == "from file"


def test_same_content_reuploaded_is_200_same_version(member, qa):
    first = upload(member.client, RECORDS)
    assert first.status_code == 201
    again = upload(member.client, RECORDS)
    assert again.status_code == 200
    assert again.json()["digest"] == first.json()["digest"]
    assert again.json()["number"] == 1
    assert DatasetVersion.objects.count() == 1


def test_differently_formatted_equal_content_has_same_digest(member, qa):
    first = upload(member.client, RECORDS).json()
    # Other key order, whitespace, escaped unicode and blank lines: the same records.
    lines = [
        '{ "id": 1,  "answer": "4", "prompt": "What is 2+2?" }',
        "",
        '{"prompt":"Capital of France?","id":2,"answer":"Paris"}',
        '   {"tags": ["x", "y"], "prompt": "Caf\\u00e9 \\u2713", "id": 3, "answer": null}   ',
        "",
    ]
    r = upload_file(member.client, "\n".join(lines).encode())
    assert r.status_code == 200, r.content
    assert r.json()["digest"] == first["digest"] == canonical_digest(RECORDS)
    assert DatasetVersion.objects.count() == 1


def test_version_numbers_increment_and_current_pointer_moves(member, qa):
    v1 = upload(member.client, RECORDS[:1]).json()
    v2 = upload(member.client, RECORDS[:2]).json()
    assert (v1["number"], v2["number"]) == (1, 2)
    assert member.client.get(QA).json()["current_version"]["digest"] == v2["digest"]

    # An upload with set_current=false is a new version but leaves the pointer.
    v3 = upload(member.client, RECORDS, set_current=False)
    assert v3.status_code == 201 and v3.json()["number"] == 3
    assert member.client.get(QA).json()["current_version"]["digest"] == v2["digest"]

    # The same with a multipart upload (form booleans).
    v4 = upload_file(member.client, b'{"only": 1}\n', set_current="false")
    assert v4.status_code == 201 and v4.json()["number"] == 4
    assert member.client.get(QA).json()["current_version"]["number"] == 2

    listed = member.client.get(VERSIONS).json()["results"]
    assert [v["number"] for v in listed] == [4, 3, 2, 1]


def test_set_current_by_number_and_by_digest(member, qa):
    v1 = upload(member.client, RECORDS[:1]).json()
    v2 = upload(member.client, RECORDS[:2]).json()
    r = member.client.post(f"{QA}/current", {"version": "v1"})
    assert r.status_code == 200, r.content
    assert r.json()["current_version"]["digest"] == v1["digest"]
    qa.refresh_from_db()
    assert qa.current_version.number == 1

    r = member.client.post(f"{QA}/current", {"version": v2["digest"]})
    assert r.status_code == 200
    assert r.json()["current_version"]["number"] == 2

    r = member.client.post(f"{QA}/current", {"version": "v9"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    qa.refresh_from_db()
    assert qa.current_version.number == 2


def test_set_current_refuses_a_version_of_another_dataset(member, project, qa):
    other = DatasetFactory(project=project, team=project.team, slug="other")
    theirs = make_version(other, [{"x": 1}])
    r = member.client.post(f"{QA}/current", {"version": theirs.digest})
    assert r.status_code == 404
    qa.refresh_from_db()
    assert qa.current_version_id is None


def test_parents_and_lineage_edge(member, qa):
    parent = upload(member.client, RECORDS[:2]).json()
    child = upload(member.client, RECORDS, parents=["qa@v1"], message="derived")
    assert child.status_code == 201, child.content
    assert child.json()["parents"] == [parent["digest"]]

    edge = LineageEdge.objects.get(target_id=child.json()["digest"])
    assert (edge.source_type, edge.source_id, edge.relation) == (
        "dataset_version", parent["digest"], "derived")

    graph = member.client.get(
        "/api/v1/teams/acme/lineage", {"artifact": f"dataset_version:{child.json()['digest']}"}
    )
    assert graph.status_code == 200
    edges = graph.json()["edges"]
    assert len(edges) == 1
    assert edges[0]["source"] == {"type": "dataset_version", "id": parent["digest"]}
    assert edges[0]["target"] == {"type": "dataset_version", "id": child.json()["digest"]}
    assert edges[0]["relation"] == "derived"
    nodes = {(n["type"], n["id"]) for n in graph.json()["nodes"]}
    assert ("dataset_version", parent["digest"]) in nodes

    # By digest prefix too.
    grandchild = upload(member.client, RECORDS[:1], parents=[f"qa@{child.json()['digest'][:12]}"])
    assert grandchild.json()["parents"] == [child.json()["digest"]]


def test_unknown_parent_is_400_and_creates_nothing(member, qa):
    r = upload(member.client, RECORDS, parents=["qa@v7"])
    assert r.status_code == 400
    assert "v7" in r.json()["message"]
    assert not DatasetVersion.objects.exists()


def test_lineage_needs_a_typed_artifact(member, team):
    r = member.client.get("/api/v1/teams/acme/lineage", {"artifact": "bogus:1"})
    assert r.status_code == 400 and "artifact" in r.json()["errors"]


def test_records_endpoint_with_offset_and_limit(member, qa):
    records = [{"i": i, "text": f"row {i}"} for i in range(7)]
    v = upload(member.client, records).json()
    url = f"{VERSIONS}/{v['digest']}/records"
    r = member.client.get(url, {"offset": 2, "limit": 3})
    assert r.status_code == 200, r.content
    assert r.json() == {"offset": 2, "limit": 3, "total": 7, "records": records[2:5]}
    # By version number, past the end, and the default page.
    tail = member.client.get(f"{VERSIONS}/v1/records", {"offset": 5, "limit": 10}).json()
    assert tail["records"] == records[5:]
    assert member.client.get(url).json()["records"] == records
    bad = member.client.get(url, {"limit": 0})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid"
    assert member.client.get(url, {"offset": "x"}).status_code == 400
    assert member.client.get(f"{VERSIONS}/v5/records").status_code == 404


def test_schema_is_inferred(member, qa):
    records = [
        {"a": 1, "b": "x", "c": True},
        {"a": 1.5, "b": None, "d": [1]},
        {"a": 2, "e": {"k": "v"}},
    ]
    body = upload(member.client, records).json()
    assert body["schema"] == {
        "a": ["integer", "number"],
        "b": ["null", "string"],
        "c": ["boolean"],
        "d": ["array"],
        "e": ["object"],
    }


def test_version_retrieve_by_number_and_digest(member, qa):
    v = upload(member.client, RECORDS).json()
    assert member.client.get(f"{VERSIONS}/v1").json()["digest"] == v["digest"]
    assert member.client.get(f"{VERSIONS}/{v['digest']}").json()["number"] == 1
    missing = member.client.get(f"{VERSIONS}/v2")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    assert member.client.get("/api/v1/teams/acme/datasets/nope/versions").status_code == 404


# --- immutability ----------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    {"record_count": 999},
    {"digest": "0" * 64},
    {"uri": "file:///elsewhere.jsonl"},
    {"number": 42},
])
def test_dataset_versions_are_immutable_in_the_database(qa, change):
    version = make_version(qa, RECORDS)
    with pytest.raises(DatabaseError), transaction.atomic():
        DatasetVersion.objects.filter(pk=version.pk).update(**change)
    fresh = DatasetVersion.objects.get(pk=version.pk)
    assert fresh.record_count == 3
    assert fresh.digest == version.digest
    assert fresh.number == 1
    assert fresh.uri == version.uri


def test_model_save_of_a_version_is_refused_too(qa):
    version = make_version(qa, RECORDS)
    version.record_count = 1
    with pytest.raises(DatabaseError), transaction.atomic():
        version.save()
    assert DatasetVersion.objects.get(pk=version.pk).record_count == 3


# --- bad input: 4xx, JSON error, no row ------------------------------------------------------


def assert_no_version() -> None:
    assert not DatasetVersion.objects.exists()


def test_malformed_json_body_is_400_json(member, qa):
    r = member.client.post(VERSIONS, data='{"records": [{"a": 1},', content_type="application/json")
    assert r.status_code == 400
    assert r["Content-Type"].startswith("application/json")
    assert r.json()["code"] == "parse_error"
    assert r.json()["message"]
    assert_no_version()


def test_jsonl_with_bad_line_3_names_line_3(member, qa):
    content = b'{"a": 1}\n{"a": 2}\n{"a": 3,,}\n{"a": 4}\n'
    r = upload_file(member.client, content)
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "invalid"
    assert "Line 3" in body["message"]
    assert body["errors"] == {"file": ["line 3"]}
    assert_no_version()


def test_a_record_that_is_a_list_is_400(member, qa):
    r = upload(member.client, [{"a": 1}, [1, 2]])
    assert r.status_code == 400
    assert "Record 1" in r.json()["message"] and "array" in r.json()["message"]
    assert_no_version()


def test_a_jsonl_line_that_is_not_an_object_is_400(member, qa):
    r = upload_file(member.client, b'{"a": 1}\n"just a string"\n')
    assert r.status_code == 400
    assert "object" in r.json()["message"]
    assert_no_version()


def test_empty_records_is_400(member, qa):
    r = upload(member.client, [])
    assert r.status_code == 400
    assert r.json()["code"] == "invalid"
    assert "at least one record" in r.json()["message"]
    assert_no_version()
    # An empty (or blank-lines-only) file too.
    assert upload_file(member.client, b"\n\n").status_code == 400
    assert_no_version()


def test_records_and_file_together_or_neither_is_400(member, qa):
    r = member.client.post(VERSIONS, {"message": "nothing"}, format="json")
    assert r.status_code == 400 and "exactly one" in r.json()["message"]
    assert_no_version()


def test_records_must_be_a_list(member, qa):
    r = member.client.post(VERSIONS, {"records": {"a": 1}}, format="json")
    assert r.status_code == 400 and "records" in r.json()["errors"]
    assert_no_version()


def test_more_than_max_upload_records_is_413(member, qa, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MAX_UPLOAD_RECORDS": 3}
    ok = upload(member.client, [{"i": i} for i in range(3)])
    assert ok.status_code == 201
    r = upload(member.client, [{"i": i} for i in range(4)])
    assert r.status_code == 413
    assert r.json()["code"] == "payload_too_large"
    assert "3" in r.json()["message"]
    file_r = upload_file(member.client, b"".join(b'{"j": %d}\n' % i for i in range(5)))
    assert file_r.status_code == 413
    assert DatasetVersion.objects.count() == 1


def test_uploads_leave_no_temp_files(member, qa, settings, tmp_path):
    settings.VAR_DIR = tmp_path / "var"
    assert upload_file(member.client, b'{"a": 1}\nnot json\n').status_code == 400
    assert upload(member.client, [{"a": 1}, [2]]).status_code == 400
    assert upload(member.client, [{"a": 1}]).status_code == 201
    assert upload(member.client, [{"a": 1}]).status_code == 200
    assert list((tmp_path / "var" / "uploads").iterdir()) == []


def test_idempotency_key_on_upload(member, qa):
    headers = {"HTTP_IDEMPOTENCY_KEY": "upload-1"}
    first = member.client.post(VERSIONS, {"records": RECORDS}, format="json", **headers)
    second = member.client.post(VERSIONS, {"records": RECORDS}, format="json", **headers)
    assert first.status_code == second.status_code == 201
    assert second["Idempotent-Replayed"] == "true"
    assert second.json() == first.json()
    other = member.client.post(VERSIONS, {"records": RECORDS[:1]}, format="json", **headers)
    assert other.status_code == 400 and other.json()["code"] == "idempotency_key_reused"
    assert DatasetVersion.objects.count() == 1


# --- environments ----------------------------------------------------------------------------

ENVS = "/api/v1/teams/acme/environments"
SPEC = {"env": {"source": "builtin", "name": "math", "params": {"count": 40, "seed": 1}}}


def spec_digest(spec: dict) -> str:
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def test_environment_versions_are_content_addressed(member, project):
    r = member.client.post(ENVS, {"slug": "gsm", "project": "main"})
    assert r.status_code == 201, r.content
    assert member.client.post(ENVS, {"slug": "gsm", "project": "main"}).status_code == 409
    assert member.client.post(ENVS, {"slug": "x", "project": "nope"}).status_code == 400

    v1 = member.client.post(f"{ENVS}/gsm/versions", {"spec": SPEC}, format="json")
    assert v1.status_code == 201, v1.content
    # The stored spec is the validated, normalised one (defaults filled in); its hash is the id.
    stored = v1.json()["spec"]
    assert stored["env"]["params"] == {"count": 40, "seed": 1}
    assert v1.json()["digest"] == spec_digest(stored)
    assert v1.json()["number"] == 1
    assert v1.json()["qc_status"] == "pending"

    reordered = {"env": {"params": {"seed": 1, "count": 40}, "name": "math", "source": "builtin"}}
    again = member.client.post(f"{ENVS}/gsm/versions", {"spec": reordered}, format="json")
    assert again.status_code == 200
    assert again.json()["digest"] == v1.json()["digest"] and again.json()["number"] == 1

    other = {"env": {"source": "builtin", "name": "math", "params": {"count": 50, "seed": 1}}}
    v2 = member.client.post(f"{ENVS}/gsm/versions", {"spec": other}, format="json")
    assert v2.status_code == 201 and v2.json()["number"] == 2
    assert EnvironmentVersion.objects.count() == 2

    got = member.client.get(f"{ENVS}/gsm/versions/v1")
    assert got.status_code == 200 and got.json()["spec"] == stored
    by_digest = member.client.get(f"{ENVS}/gsm/versions/{v2.json()['digest'][:10]}")
    assert by_digest.json()["number"] == 2
    assert member.client.get(f"{ENVS}/gsm/versions/v3").status_code == 404
    listed = member.client.get(f"{ENVS}/gsm/versions").json()["results"]
    assert [v["number"] for v in listed] == [2, 1]


def test_environment_version_needs_a_non_empty_spec(member, project):
    member.client.post(ENVS, {"slug": "gsm", "project": "main"})
    r = member.client.post(f"{ENVS}/gsm/versions", {"spec": {}}, format="json")
    assert r.status_code == 400 and "spec" in r.json()["message"]
    r = member.client.post(f"{ENVS}/gsm/versions", {"spec": [1]}, format="json")
    assert r.status_code == 400 and "spec" in r.json()["errors"]
    assert member.client.post(f"{ENVS}/none/versions", {"spec": SPEC},
                              format="json").status_code == 404
    assert not EnvironmentVersion.objects.exists()


def test_idempotency_key_reused_with_another_file_is_refused(member, qa):
    headers = {"HTTP_IDEMPOTENCY_KEY": "file-upload-1"}
    first = upload_file(member.client, b'{"a": 1}\n', headers)
    assert first.status_code == 201, first.content
    replay = upload_file(member.client, b'{"a": 1}\n', headers)
    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    assert replay.json()["digest"] == first.json()["digest"]
    # Same file name, other content: a different request, not a retry.
    other = upload_file(member.client, b'{"a": 2}\n', headers)
    assert other.status_code == 400, other.content
    assert other.json()["code"] == "idempotency_key_reused"
    assert DatasetVersion.objects.count() == 1
