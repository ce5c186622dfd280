"""Alert rule CRUD through the API: members write, viewers read, other teams get 404, bad
input is a 400 naming the field (nothing written), webhook URLs to private hosts are
refused, every write is audited, lists page by cursor."""

from __future__ import annotations

from typing import Any

import pytest
from standardwebhooks import Webhook

from apps.alerts.models import AlertRule
from apps.core.models import AuditLog

URL = "/api/v1/teams/acme/alert-rules"


@pytest.fixture
def loopback_ok(settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "WEBHOOK_ALLOW_PRIVATE": True}


def test_member_creates_a_rule_with_a_webhook_secret_shown_once(member, viewer, loopback_ok):
    r = member.client.post(URL, {"name": "nan", "kind": "nan_streak", "params": {"streak": 3},
                                 "webhook_url": "http://127.0.0.1:9/hook"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["params"] == {"streak": 3} and body["has_webhook_secret"]
    assert body["webhook_secret"].startswith("whsec_")
    Webhook(body["webhook_secret"])  # a secret the verifier library accepts
    assert r.headers["Cache-Control"].startswith("max-age=0")
    # Never shown again; viewers read, but do not write.
    got = viewer.client.get(f"{URL}/{body['id']}").json()
    assert "webhook_secret" not in got and got["kind"] == "nan_streak"
    assert viewer.client.post(URL, {"name": "x", "kind": "nan_streak"},
                              format="json").status_code == 403
    assert viewer.client.patch(f"{URL}/{body['id']}", {"enabled": False},
                               format="json").status_code == 403
    assert AuditLog.objects.filter(action="alert_rule.create", target_id=str(body["id"]),
                                   actor__username="mia").exists()


def test_update_rotate_delete_are_audited(member, loopback_ok):
    rid = member.client.post(URL, {"name": "kl", "kind": "mismatch_kl"},
                             format="json").json()["id"]
    r = member.client.patch(f"{URL}/{rid}", {"params": {"bound": 0.2}, "cooldown_s": 60},
                            format="json")
    assert r.status_code == 200, r.content
    assert r.json()["params"] == {"bound": 0.2, "for_points": 1}
    assert r.json()["cooldown_s"] == 60 and r.json()["name"] == "kl"
    # No webhook, no secret to rotate; once it has one, rotation gives a new one.
    assert member.client.post(f"{URL}/{rid}/rotate-secret").status_code == 400
    member.client.patch(f"{URL}/{rid}", {"webhook_url": "http://127.0.0.1:9/h"}, format="json")
    first = AlertRule.objects.get(pk=rid).webhook_secret
    rotated = member.client.post(f"{URL}/{rid}/rotate-secret").json()["webhook_secret"]
    assert rotated.startswith("whsec_") and rotated != first
    assert member.client.delete(f"{URL}/{rid}").status_code == 204
    assert not AlertRule.objects.filter(pk=rid).exists()
    actions = set(AuditLog.objects.filter(target_type="alert_rule", target_id=str(rid))
                  .values_list("action", flat=True))
    assert actions == {"alert_rule.create", "alert_rule.update", "alert_rule.rotate_secret",
                       "alert_rule.delete"}


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "x", "kind": "nope"}, "kind"),
    ({"name": "x", "kind": "nan_streak", "params": {"streak": 0}}, "params.streak"),
    ({"name": "x", "kind": "nan_streak", "params": {"streek": 2}}, "params.streek"),
    ({"name": "x", "kind": "nan_streak", "params": [1]}, "params"),
    ({"name": "x", "kind": "metric_above", "params": {"threshold": 1}}, "params.metric"),
    ({"name": "x", "kind": "reward_collapse", "params": {"alpha": 2}}, "params.alpha"),
    ({"name": "x", "kind": "queue_wait", "params": {"pool": "tpu"}}, "params.pool"),
    ({"name": "x", "kind": "nan_streak", "cooldown_s": -1}, "cooldown_s"),
    ({"name": "x", "kind": "nan_streak", "project": "nope"}, "project"),
    ({"name": "x", "kind": "nan_streak", "evil": 1}, "evil"),
    ({"kind": "nan_streak"}, "name"),
])
def test_bad_input_is_a_400_naming_the_field_and_writes_nothing(member, body, field):
    r = member.client.post(URL, body, format="json")
    assert r.status_code == 400, r.content
    assert field in str(r.json()), r.json()
    assert not AlertRule.objects.exists()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/hook", "http://localhost/hook", "http://[::1]/x",
    "http://10.1.2.3/x", "http://192.168.0.7/x", "http://169.254.169.254/latest/meta-data",
    "http://0.0.0.0/x", "ftp://example.com/x", "http://user:pw@8.8.8.8/x", "not a url",
])
def test_webhook_urls_to_private_or_odd_hosts_are_refused(member, url):
    r = member.client.post(URL, {"name": "x", "kind": "nan_streak", "webhook_url": url},
                           format="json")
    assert r.status_code == 400, (url, r.content)
    assert "webhook_url" in r.json()["errors"]
    assert not AlertRule.objects.exists()


def test_link_local_stays_refused_even_when_private_hosts_are_allowed(member, loopback_ok):
    r = member.client.post(URL, {"name": "x", "kind": "nan_streak",
                                 "webhook_url": "http://169.254.169.254/"}, format="json")
    assert r.status_code == 400 and "link-local" in r.json()["message"]


def test_other_teams_see_404_everywhere(member, outsider, other_team):
    rid = member.client.post(URL, {"name": "w", "kind": "worker_lost"}, format="json").json()["id"]
    c = outsider.client
    assert c.get(URL).status_code == 404
    assert c.get(f"{URL}/{rid}").status_code == 404
    assert c.patch(f"{URL}/{rid}", {"enabled": False}, format="json").status_code == 404
    assert c.delete(f"{URL}/{rid}").status_code == 404
    assert c.get("/api/v1/teams/acme/alerts").status_code == 404
    assert c.get("/api/v1/teams/acme/webhook-deliveries").status_code == 404
    # Their own team's URL does not reach this team's rule either.
    assert c.get(f"/api/v1/teams/rival/alert-rules/{rid}").status_code == 404
    assert c.get("/api/v1/teams/rival/alert-rules").json()["results"] == []
    assert AlertRule.objects.get(pk=rid).enabled


def test_lists_page_by_cursor_and_filter(member):
    for i in range(5):
        member.client.post(URL, {"name": f"r{i}", "kind": "nan_streak" if i % 2 else
                                 "worker_lost"}, format="json")
    page = member.client.get(URL, {"page_size": 2}).json()
    assert len(page["results"]) == 2 and page["next"]
    names = [r["name"] for r in page["results"]]
    while page["next"]:
        page = member.client.get(page["next"]).json()
        names += [r["name"] for r in page["results"]]
    assert sorted(names) == [f"r{i}" for i in range(5)]
    only = member.client.get(URL, {"kind": "nan_streak"}).json()["results"]
    assert {r["name"] for r in only} == {"r1", "r3"}
    assert member.client.get("/api/v1/teams/acme/alerts", {"run": "not-a-uuid"}
                             ).status_code == 400
    assert member.client.get(URL, {"page_size": 0}).status_code == 400


def test_kinds_lists_each_kinds_parameters(viewer):
    kinds = viewer.client.get(f"{URL}/kinds").json()
    assert set(kinds) >= {"nan_streak", "reward_collapse", "mismatch_kl", "worker_lost",
                          "node_lost", "queue_wait", "sandbox_error_rate", "forgery_suspect"}
    assert kinds["reward_collapse"]["properties"]["alpha"]["default"] == 0.1
