"""Dataset exports (``…/versions/<digest>/export``, JSON lines) through the team's filter:
off and flag send the records as stored (flag says what it found in headers and logs it),
redact replaces findings, block refuses the export before a byte is sent."""

from __future__ import annotations

import json

import pytest

from apps.filtering.models import FilterPolicy, Finding
from tests.factories import DatasetFactory, make_version
from tests.workers.filtering.planted import AWS_KEY, CLEAN, EMAIL, LEAKY, OPENAI_KEY

pytestmark = pytest.mark.django_db

RECORDS = [{"id": 1, "prompt": "17+25?", "answer": CLEAN},
           {"id": 2, "prompt": f"write to {EMAIL}", "answer": LEAKY,
            "meta": {"tags": ["ok", OPENAI_KEY], "score": 0.5}},
           {"id": 3, "prompt": "x", "answer": "y"}]


@pytest.fixture
def version(project, team, object_store):
    dataset = DatasetFactory(project=project, team=team, slug="leaky")
    return make_version(dataset, RECORDS)


def url(version) -> str:
    return f"/api/v1/teams/acme/datasets/leaky/versions/{version.digest}/export"


def lines(response) -> list[dict]:
    body = b"".join(response.streaming_content).decode()
    assert body.endswith("\n")
    return [json.loads(line) for line in body.splitlines()]


def test_off_exports_the_records_as_stored(viewer, version):
    r = viewer.client.get(url(version))
    assert r.status_code == 200
    assert r["Content-Type"] == "application/x-ndjson"
    assert r["X-Crucible-Filter"] == "off"
    assert 'filename="leaky-v1.jsonl"' in r["Content-Disposition"]
    assert lines(r) == RECORDS
    assert not Finding.objects.exists()


def test_flag_exports_as_stored_and_says_what_it_found(viewer, version, team):
    FilterPolicy.objects.create(team=team, export="flag")
    r = viewer.client.get(url(version))
    assert lines(r) == RECORDS
    assert (r["X-Crucible-Filter"], r["X-Crucible-Filter-Records"]) == ("flag", "1")
    assert r["X-Crucible-Filter-Kinds"] == "aws-access-key,email,github-token,openai-token"
    (finding,) = Finding.objects.filter(team=team)
    assert (finding.surface, finding.action, finding.target_type, finding.target_id,
            finding.count) == ("export", "flag", "dataset-version", version.digest, 1)


def test_redact_replaces_every_finding(viewer, version, team):
    FilterPolicy.objects.create(team=team, export="redact")
    r = viewer.client.get(url(version))
    out = lines(r)
    assert out[0] == RECORDS[0] and out[2] == RECORDS[2]
    assert out[1]["prompt"] == "write to [REDACTED:email]"
    assert out[1]["meta"] == {"tags": ["ok", "[REDACTED:openai-token]"], "score": 0.5}
    text = json.dumps(out)
    for secret in (AWS_KEY, OPENAI_KEY, EMAIL):
        assert secret not in text
    assert r["X-Crucible-Filter-Records"] == "1"


def test_block_refuses_an_export_with_findings(viewer, version, team, project):
    FilterPolicy.objects.create(team=team, export="block")
    r = viewer.client.get(url(version))
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "output_blocked" and "1 records contain" in body["message"]
    assert body["errors"]["blocked"] == [{"index": 1, "kinds": [
        "aws-access-key", "email", "github-token", "openai-token"]}]
    assert Finding.objects.get(team=team).action == "block"
    clean = make_version(DatasetFactory(project=project, team=team, slug="clean"),
                         [RECORDS[0], RECORDS[2]])
    ok = viewer.client.get(f"/api/v1/teams/acme/datasets/clean/versions/{clean.digest}/export")
    assert ok.status_code == 200 and lines(ok) == [RECORDS[0], RECORDS[2]]


def test_other_teams_get_404_and_their_policy_does_not_apply(outsider, viewer, version,
                                                             other_team):
    FilterPolicy.objects.create(team=other_team, export="block")
    assert outsider.client.get(url(version)).status_code == 404
    r = viewer.client.get(url(version))
    assert r.status_code == 200 and lines(r) == RECORDS
    missing = "/api/v1/teams/acme/datasets/leaky/versions/" + "0" * 64 + "/export"
    assert viewer.client.get(missing).status_code == 404
