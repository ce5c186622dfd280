"""The team's output-filter policy: read by any member, set by admins (audited), 404 to
other teams; its page; the findings log is the team's own."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.core.models import AuditLog
from apps.filtering.models import FilterPolicy, Finding

pytestmark = pytest.mark.django_db
POLICY = "/api/v1/teams/acme/filtering/policy"
FINDINGS = "/api/v1/teams/acme/filtering/findings"
PAGE = "/t/acme/filtering/"


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_team_that_never_chose_filters_nothing(viewer):
    body = viewer.client.get(POLICY).json()
    assert {k: body[k] for k in ("samples", "serve", "export")} == \
        {"samples": "off", "serve": "off", "export": "off"}
    assert body["modes"] == ["off", "flag", "redact", "block"]
    assert {"aws-access-key", "github-token", "openai-token", "email"} <= set(body["kinds"])
    assert not FilterPolicy.objects.exists()  # reading writes nothing


def test_an_admin_sets_some_surfaces_and_it_is_audited(admin, viewer, team):
    r = admin.client.patch(POLICY, {"samples": "redact", "export": "block"}, format="json")
    assert r.status_code == 200, r.content
    assert (r.json()["samples"], r.json()["serve"], r.json()["export"]) == \
        ("redact", "off", "block")
    assert r.json()["updated_by"] == "adam"
    r = admin.client.patch(f"{POLICY}/", {"serve": "flag"}, format="json")
    assert (r.json()["samples"], r.json()["serve"]) == ("redact", "flag")
    assert viewer.client.get(POLICY).json()["serve"] == "flag"
    rows = AuditLog.objects.filter(team=team, action="filtering.policy").order_by("id")
    assert [r.data["after"] for r in rows] == [
        {"samples": "redact", "serve": "off", "export": "block"},
        {"samples": "redact", "serve": "flag", "export": "block"}]


@pytest.mark.parametrize("body", [{}, {"samples": "shout"}, {"samples": None},
                                  {"samples": "flag", "sample": "flag"}, ["flag"]])
def test_bad_policy_documents_are_400_and_change_nothing(admin, body):
    r = admin.client.patch(POLICY, body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["message"]
    assert not FilterPolicy.objects.exists()


def test_members_and_viewers_cannot_set_it_and_other_teams_get_404(member, viewer, outsider):
    for caller in (member, viewer):
        assert caller.client.patch(POLICY, {"samples": "off"}, format="json").status_code == 403
    assert outsider.client.get(POLICY).status_code == 404
    assert outsider.client.patch(POLICY, {"samples": "block"}, format="json").status_code == 404
    assert outsider.client.get(FINDINGS).status_code == 404
    assert not FilterPolicy.objects.exists()


def test_findings_list_only_the_teams_own(viewer, team, other_team):
    Finding.objects.create(team=team, surface="samples", action="flag", target_type="sample",
                           target_id="1", kinds=["email"])
    Finding.objects.create(team=other_team, surface="export", action="block",
                           target_type="dataset-version", target_id="abc", kinds=["aws"])
    rows = viewer.client.get(FINDINGS).json()["results"]
    assert [(f["surface"], f["kinds"]) for f in rows] == [("samples", ["email"])]
    assert viewer.client.get(FINDINGS, {"surface": "export"}).json()["results"] == []


def test_the_page_shows_the_policy_and_admins_change_it(admin, viewer, outsider, team):
    html = signed_in(viewer.user).get(PAGE).content.decode()
    assert "<h1>Output filtering" in html and 'id="mode-samples">off</span>' in html
    assert "Only team admins change the policy." in html
    assert signed_in(viewer.user).post(PAGE, {"samples": "block", "serve": "off",
                                              "export": "off"}).status_code == 403
    assert signed_in(outsider.user).get(PAGE).status_code == 404
    client = signed_in(admin.user)
    r = client.post(PAGE, {"samples": "flag", "serve": "redact", "export": "block"})
    assert r.status_code == 302
    policy = FilterPolicy.objects.get(team=team)
    assert (policy.samples, policy.serve, policy.export) == ("flag", "redact", "block")
    html = client.get(PAGE).content.decode()
    assert '<option value="redact" selected>' in html
    bad = client.post(PAGE, {"samples": "loud", "serve": "off", "export": "off"})
    assert bad.status_code == 400 and "Unknown mode for samples" in bad.content.decode()
    assert FilterPolicy.objects.get(team=team).samples == "flag"
    # The team settings page links to it.
    assert f'href="{PAGE}">Output filtering</a>' in \
        signed_in(viewer.user).get("/t/acme/team/").content.decode()
