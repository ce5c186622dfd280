"""Stored samples through the team's filter: flag keeps them and shows the flag, redact
stores ``[REDACTED:<kind>]``, block refuses the batch (422, nothing stored) and the
worker's session leaves the blocked rows out, counts them and sends the rest."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.filtering.models import FilterPolicy, Finding
from apps.runs.models import Sample
from tests.factories import make_run
from tests.workers.filtering.planted import (
    AWS_KEY,
    CLEAN,
    EMAIL,
    GITHUB_TOKEN,
    LEAKY,
    OPENAI_KEY,
)

pytestmark = pytest.mark.django_db
W = "/api/v1/worker"
RUNS = "/api/v1/teams/acme/runs"


@pytest.fixture
def running(worker, project, qa):
    run = make_run(project, qa)
    r = worker.post(f"{W}/claim", {"pool": run.pool, "worker_id": "w1",
                                    "run_id": str(run.pk)}, format="json")
    assert r.status_code == 200, r.content
    lease = {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}
    assert worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"},
                       **lease).status_code == 200
    return run, lease


def batch():
    return [{"step": 1, "prompt": "What is 17+25?", "completion": CLEAN, "reward": 1.0},
            {"step": 1, "prompt": f"Mail {EMAIL} the key", "completion": LEAKY, "reward": 0.0},
            {"step": 1, "prompt": "token?", "completion": f"here: {GITHUB_TOKEN}"}]


def post(worker, run, lease, rows):
    return worker.post(f"{W}/runs/{run.pk}/samples", {"samples": rows}, format="json", **lease)


def listed(member, run):
    return {s["prompt"]: s for s in member.client.get(f"{RUNS}/{run.pk}/samples").json()
            ["results"]}


def test_off_stores_samples_as_written(worker, running, member):
    run, lease = running
    assert post(worker, run, lease, batch()).status_code == 201
    rows = listed(member, run)
    assert rows["What is 17+25?"]["filter"] is None
    assert rows[f"Mail {EMAIL} the key"]["completion"] == LEAKY
    assert not Finding.objects.exists()


def test_flag_stores_as_written_and_shows_the_flag(worker, running, member, team):
    FilterPolicy.objects.create(team=team, samples="flag")
    run, lease = running
    assert post(worker, run, lease, batch()).json() == {"stored": 3}
    rows = listed(member, run)
    leaky = rows[f"Mail {EMAIL} the key"]
    assert leaky["completion"] == LEAKY
    assert leaky["filter"] == {"action": "flag", "kinds": ["aws-access-key", "email",
                                                           "github-token", "openai-token"]}
    assert rows["token?"]["filter"] == {"action": "flag", "kinds": ["github-token"]}
    assert rows["What is 17+25?"]["filter"] is None
    assert set(Finding.objects.filter(team=team, target_type="sample")
               .values_list("target_id", flat=True)) == {str(leaky["id"]),
                                                         str(rows["token?"]["id"])}
    # ... and on the run page's samples table.
    client = Client()
    client.force_login(member.user)
    html = client.get(f"/t/acme/runs/{run.pk}/samples/").content.decode()
    assert html.count('class="badge filter-flag"') == 2
    assert "flagged: github-token" in html


def test_redact_stores_placeholders_never_the_secret(worker, running, member, team):
    FilterPolicy.objects.create(team=team, samples="redact")
    run, lease = running
    assert post(worker, run, lease, batch()).status_code == 201
    stored = " ".join(Sample.objects.filter(run=run).values_list("prompt", flat=True)) + \
        " ".join(Sample.objects.filter(run=run).values_list("completion", flat=True))
    for secret in (AWS_KEY, GITHUB_TOKEN, OPENAI_KEY, EMAIL):
        assert secret not in stored
    rows = listed(member, run)
    leaky = rows["Mail [REDACTED:email] the key"]
    assert leaky["completion"].startswith("Use the key [REDACTED:aws-access-key] with token "
                                          "[REDACTED:github-token];")
    assert leaky["filter"]["action"] == "redact"
    assert rows["What is 17+25?"]["completion"] == CLEAN


def test_block_refuses_the_batch_naming_rows_and_kinds(worker, running, team):
    FilterPolicy.objects.create(team=team, samples="block")
    run, lease = running
    r = post(worker, run, lease, batch())
    assert r.status_code == 422, r.content
    body = r.json()
    assert body["code"] == "output_blocked"
    assert "2 of 3 rows" in body["message"]
    assert body["errors"]["blocked"] == [
        {"index": 1, "kinds": ["aws-access-key", "email", "github-token", "openai-token"]},
        {"index": 2, "kinds": ["github-token"]}]
    assert GITHUB_TOKEN not in r.content.decode()  # the refusal does not echo the secret
    assert not Sample.objects.filter(run=run).exists()  # nothing half written
    (finding,) = Finding.objects.filter(team=team)
    assert (finding.action, finding.target_type, finding.target_id, finding.count) == \
        ("block", "run", str(run.pk), 2)
    assert post(worker, run, lease, batch()[:1]).status_code == 201  # clean rows go in


def test_a_stale_lease_is_409_before_any_screening(worker, running, team):
    FilterPolicy.objects.create(team=team, samples="block")
    run, _ = running
    r = post(worker, run, {"HTTP_X_CRUCIBLE_LEASE": "not-the-lease"}, batch())
    assert r.status_code == 409
    assert not Finding.objects.exists()


def test_another_teams_policy_does_not_apply(worker, running, member, other_team):
    FilterPolicy.objects.create(team=other_team, samples="block")
    run, lease = running
    assert post(worker, run, lease, batch()).status_code == 201
    assert listed(member, run)[f"Mail {EMAIL} the key"]["completion"] == LEAKY


def test_the_worker_session_drops_blocked_rows_counts_them_and_sends_the_rest(
        pool, project, qa, team):
    FilterPolicy.objects.create(team=team, samples="block")
    run = make_run(project, qa)
    session = pool.claim(run.pool, "w1", run_id=str(run.pk))
    session.set_status("running")
    assert session.add_samples(batch()) == {"stored": 1}
    assert session.blocked_samples == 2
    assert list(Sample.objects.filter(run=run).values_list("completion", flat=True)) == [CLEAN]
    # A batch of blocked rows only: nothing stored, no error, counted.
    assert session.add_samples(batch()[1:]) == {"stored": 0, "blocked": 2}
    assert session.blocked_samples == 4
    session.close()


def test_a_queued_batch_that_is_blocked_is_trimmed_and_delivered(pool, project, qa, team):
    """Batches queued while the API was away (the outbox) get the same handling. The
    outbox's sender is called here in the test's thread (its own thread would not see this
    test's uncommitted rows)."""
    import orjson

    from workers.outbox import Item

    FilterPolicy.objects.create(team=team, samples="block")
    run = make_run(project, qa)
    session = pool.claim(run.pool, "w1", run_id=str(run.pk))
    session.set_status("running")
    content = orjson.dumps({"samples": batch()})
    session._deliver(Item(f"worker/runs/{run.pk}/samples",
                          {**session.headers, "Idempotency-Key": "k1"}, len(content),
                          body=content))
    assert session.blocked_samples == 2 and not session.lease_lost
    assert list(Sample.objects.filter(run=run).values_list("completion", flat=True)) == [CLEAN]
    session.close()
