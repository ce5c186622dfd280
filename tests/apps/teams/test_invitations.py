"""No existence oracles: people join teams with invite codes (no endpoint takes a username
and so none says whether it exists), every bad code gets one answer, and a taken team slug
is "not available" exactly like a reserved one, naming no owner."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.teams.models import Invitation, Membership, Role
from tests.factories import TeamFactory

INV = "/api/v1/teams/acme/invitations"
ACCEPT = "/api/v1/invitations/accept"


def _invite(client, **body) -> dict:
    r = client.post(INV, {"role": "member", **body}, format="json")
    assert r.status_code == 201, r.content
    assert "no-store" in r["Cache-Control"]
    return r.json()


def test_an_admin_invites_and_the_invitee_joins_with_the_role(admin, make_caller, team):
    made = _invite(admin.client, role="viewer", max_uses=2, expires_in_hours=2)
    assert made["code"].startswith(f"cri_{made['prefix']}_") and made["usable"] is True
    listed = admin.client.get(INV).json()["results"]
    assert [i["prefix"] for i in listed] == [made["prefix"]]
    assert "code" not in listed[0] and made["code"] not in admin.client.get(INV).content.decode()
    assert Invitation.objects.get().code_hash != made["code"]  # only a hash is kept
    first, second, third = (make_caller(None) for _ in range(3))
    for person in (first, second):
        r = person.client.post(ACCEPT, {"code": made["code"]}, format="json")
        assert r.status_code == 201 and r.json() == {"team": "acme", "role": "viewer"}
        assert Membership.objects.get(team=team, user=person.user).role == Role.VIEWER
    used_up = third.client.post(ACCEPT, {"code": made["code"]}, format="json")
    assert used_up.status_code == 404
    assert not Membership.objects.filter(user=third.user).exists()


def test_every_bad_code_gets_the_same_answer(admin, make_caller, settings):
    caller = make_caller(None)
    good = _invite(admin.client)
    expired = _invite(admin.client)
    Invitation.objects.filter(prefix=expired["prefix"]).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    revoked = _invite(admin.client)
    assert admin.client.delete(f"{INV}/{revoked['prefix']}").status_code == 204
    prefix = good["prefix"]
    codes = ["nonsense", "cri_", f"cri_{prefix}_wrong-secret", "cri_000000000000_x",
             expired["code"], revoked["code"], good["code"].replace("cri_", "crc_")]
    answers = set()
    for code in codes:
        r = caller.client.post(ACCEPT, {"code": code}, format="json")
        assert r.status_code == 404, (code, r.content)
        answers.add((r.json()["code"], r.json()["message"]))
    assert len(answers) == 1 and answers.pop()[0] == "invalid_invitation"
    # The good code still works after all that.
    assert caller.client.post(ACCEPT, {"code": good["code"]}, format="json").status_code == 201


def test_guessing_codes_is_throttled_per_address(admin, make_caller, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "THROTTLE_RATES": {
        **settings.CRUCIBLE["THROTTLE_RATES"], "auth_failure": "3/min"}}
    good = _invite(admin.client)
    caller = make_caller(None)
    for n in range(3):
        assert caller.client.post(ACCEPT, {"code": f"cri_{good['prefix']}_guess{n}"},
                                  format="json", REMOTE_ADDR="10.2.2.2").status_code == 404
    refused = caller.client.post(ACCEPT, {"code": good["code"]}, format="json",
                                 REMOTE_ADDR="10.2.2.2")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert not Membership.objects.filter(user=caller.user).exists()


@pytest.mark.parametrize("who", ["member", "viewer"])
def test_only_admins_manage_invitations(who, request, admin, outsider):
    caller = request.getfixturevalue(who)
    made = _invite(admin.client)
    assert caller.client.post(INV, {"role": "member"}, format="json").status_code == 403
    assert caller.client.get(INV).status_code == 403
    assert caller.client.delete(f"{INV}/{made['prefix']}").status_code == 403
    assert outsider.client.get(INV).status_code == 404
    assert Invitation.objects.get().revoked_at is None


def test_owner_invitations_need_an_owner(admin, owner):
    assert admin.client.post(INV, {"role": "owner"}, format="json").status_code == 403
    _invite(owner.client, role="owner")


def test_no_team_url_takes_a_username(admin, member, make_caller):
    make_caller(None, username="exists")
    for username in ("exists", "does-not-exist"):
        r = admin.client.post("/api/v1/teams/acme/members", {"username": username,
                                                              "role": "member"},
                              format="json")
        assert r.status_code == 405
    assert not Membership.objects.filter(user__username="exists").exists()


def test_a_taken_slug_is_unavailable_like_a_reserved_one_and_names_no_owner(make_caller):
    TeamFactory(slug="secret-project", name="Hidden Corp")
    caller = make_caller(None)
    answers = {}
    for slug in ("secret-project", "Secret-Project", "admin", "api"):
        r = caller.client.post("/api/v1/teams", {"slug": slug}, format="json")
        assert r.status_code == 409, (slug, r.content)
        body = r.json()
        assert body["code"] == "slug_unavailable"
        assert "Hidden Corp" not in r.content.decode()
        answers[slug] = body["message"].replace(slug, "<slug>")
    assert len(set(answers.values())) == 1, answers
    assert caller.client.post("/api/v1/teams", {"slug": "fresh-one"},
                              format="json").status_code == 201
