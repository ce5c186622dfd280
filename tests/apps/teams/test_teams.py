"""Teams, roles, memberships, personal and worker tokens, and their audit trail."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.core.models import AuditLog
from apps.datasets.models import Dataset
from apps.projects.models import Project
from apps.runs.models import Run
from apps.teams.models import ApiToken, Membership, Role, Team, TokenKind
from tests.django_fixtures import client_for_token
from tests.factories import DatasetFactory, UserFactory, make_run

RUN_DOC = {"project": "main", "kind": "profile", "config": {}, "datasets": ["qa"]}




@pytest.fixture
def dataset(project):
    return DatasetFactory(project=project, team=project.team, slug="qa")


@pytest.fixture
def run(project, dataset):
    return make_run(project, dataset)


def audit_actions(team: Team | None = None) -> list[tuple[str, str, str]]:
    rows = AuditLog.objects.order_by("pk")
    if team is not None:
        rows = rows.filter(team=team)
    return [(r.action, r.actor_label, r.target_id) for r in rows]


def role_of(team: Team, username: str) -> str | None:
    membership = Membership.objects.filter(team=team, user__username=username).first()
    return membership.role if membership else None


# --- roles on ordinary writes -----------------------------------------------------------


def _writes(run: Run) -> list[tuple[str, str, dict]]:
    return [
        ("post", "/api/v1/teams/acme/projects", {"slug": "p2", "name": "P2"}),
        ("patch", "/api/v1/teams/acme/projects/main", {"name": "renamed"}),
        ("post", "/api/v1/teams/acme/datasets", {"slug": "d2", "project": "main"}),
        ("post", "/api/v1/teams/acme/datasets/qa/versions", {"records": [{"a": 1}]}),
        ("post", "/api/v1/teams/acme/environments", {"slug": "e2", "project": "main"}),
        ("post", "/api/v1/teams/acme/runs", RUN_DOC),
        ("post", "/api/v1/teams/acme/runs/preview", RUN_DOC),
        ("post", f"/api/v1/teams/acme/runs/{run.pk}/cancel", {}),
    ]


def _state(run: Run) -> tuple:
    run.refresh_from_db()
    return (Project.objects.count(), Dataset.objects.count(), Run.objects.count(),
            run.status, Project.objects.get(slug="main").name, AuditLog.objects.count())


def test_viewer_reads_everything(viewer, run):
    for url in ("/api/v1/teams/acme", "/api/v1/teams/acme/projects",
                "/api/v1/teams/acme/datasets", "/api/v1/teams/acme/datasets/qa/versions",
                "/api/v1/teams/acme/runs", f"/api/v1/teams/acme/runs/{run.pk}",
                f"/api/v1/teams/acme/runs/{run.pk}/events", "/api/v1/teams/acme/members"):
        response = viewer.client.get(url)
        assert response.status_code == 200, (url, response.content[:200])
    assert viewer.client.get("/api/v1/teams/acme").json()["role"] == "viewer"


def test_viewer_gets_403_on_every_write(viewer, run):
    before = _state(run)
    for method, url, body in _writes(run):
        response = getattr(viewer.client, method)(url, body, format="json")
        assert response.status_code == 403, (method, url, response.content[:200])
        error = response.json()
        assert error["code"] == "forbidden"
        assert "'member'" in error["message"] and "'viewer'" in error["message"]
    assert _state(run) == before


def test_member_can_write(member, run):
    for method, url, body in _writes(run):
        response = getattr(member.client, method)(url, body, format="json")
        assert response.status_code in (200, 201), (method, url, response.content[:200])
    run.refresh_from_db()
    assert run.status == "canceled"
    assert Project.objects.filter(slug="p2").exists()
    assert Project.objects.get(slug="main").name == "renamed"
    assert Dataset.objects.filter(slug="d2").exists()
    assert Run.objects.count() == 2


# --- who manages members and worker tokens ----------------------------------------------


def _admin_only(team: Team) -> list[tuple[str, str, dict]]:
    token = ApiToken.objects.get(kind=TokenKind.WORKER, team=team)
    return [
        ("post", "/api/v1/teams/acme/invitations", {"role": "viewer"}),
        ("get", "/api/v1/teams/acme/invitations", {}),
        ("patch", "/api/v1/teams/acme/members/victor", {"role": "admin"}),
        ("delete", "/api/v1/teams/acme/members/victor", {}),
        ("get", "/api/v1/teams/acme/worker-tokens", {}),
        ("get", f"/api/v1/teams/acme/worker-tokens/{token.prefix}", {}),
        ("post", "/api/v1/teams/acme/worker-tokens", {"name": "pool-2"}),
        ("delete", f"/api/v1/teams/acme/worker-tokens/{token.prefix}", {}),
        ("patch", "/api/v1/teams/acme", {"name": "Renamed"}),
    ]


@pytest.fixture
def team_worker_token(team, owner):
    response = owner.client.post("/api/v1/teams/acme/worker-tokens", {"name": "pool"},
                                 format="json")
    assert response.status_code == 201
    return response.json()


@pytest.mark.parametrize("who", ["member", "viewer"])
def test_members_and_viewers_cannot_manage_members_or_worker_tokens(
    who, request, team, viewer, team_worker_token
):
    UserFactory(username="newbie")
    caller = request.getfixturevalue(who)
    members_before = sorted(Membership.objects.values_list("user__username", "role"))
    tokens_before = list(ApiToken.objects.order_by("pk").values_list("prefix", "revoked_at"))
    audit_before = AuditLog.objects.count()
    for method, url, body in _admin_only(team):
        response = getattr(caller.client, method)(url, body, format="json")
        assert response.status_code == 403, (who, method, url, response.content[:200])
        assert response.json()["code"] == "forbidden"
    assert sorted(Membership.objects.values_list("user__username", "role")) == members_before
    assert list(ApiToken.objects.order_by("pk").values_list("prefix", "revoked_at")) == \
        tokens_before
    assert AuditLog.objects.count() == audit_before
    assert Team.objects.get(slug="acme").name != "Renamed"


def test_members_can_list_members(member, viewer):
    names = [m["username"] for m in member.client.get("/api/v1/teams/acme/members").json()
             ["results"]]
    assert sorted(names) == ["mia", "victor"]
    assert member.client.get("/api/v1/teams/acme/members/victor").json()["role"] == "viewer"


def _invite(client, role="member"):
    r = client.post("/api/v1/teams/acme/invitations", {"role": role}, format="json")
    assert r.status_code == 201, r.content
    return r.json()["code"]


def test_admin_manages_members_and_worker_tokens(admin, viewer, team, team_worker_token,
                                                 make_caller):
    newbie = make_caller(None, username="newbie")
    c = admin.client
    accepted = newbie.client.post("/api/v1/invitations/accept", {"code": _invite(c)},
                                  format="json")
    assert accepted.status_code == 201 and accepted.json() == {"team": "acme", "role": "member"}
    assert role_of(team, "newbie") == "member"
    assert c.patch("/api/v1/teams/acme/members/newbie", {"role": "admin"},
                   format="json").json()["role"] == "admin"
    assert role_of(team, "newbie") == "admin"
    assert c.delete("/api/v1/teams/acme/members/newbie").status_code == 204
    assert role_of(team, "newbie") is None

    listed = c.get("/api/v1/teams/acme/worker-tokens").json()["results"]
    assert [t["prefix"] for t in listed] == [team_worker_token["prefix"]]
    created = c.post("/api/v1/teams/acme/worker-tokens", {"name": "pool-2"}, format="json")
    assert created.status_code == 201
    prefix = created.json()["prefix"]
    assert c.delete(f"/api/v1/teams/acme/worker-tokens/{prefix}").status_code == 204
    assert ApiToken.objects.get(prefix=prefix).revoked_at is not None

    assert c.patch("/api/v1/teams/acme", {"name": "Acme Corp"},
                   format="json").json()["name"] == "Acme Corp"


def test_members_are_not_added_by_username(admin, member):
    """Adding by username would answer whether the username exists: people join by code."""
    c = admin.client
    for body in ({"username": "ghost"}, {"username": "mia"}):
        assert c.post("/api/v1/teams/acme/members", body, format="json").status_code == 405
    bad_role = c.post("/api/v1/teams/acme/invitations", {"role": "god"}, format="json")
    assert bad_role.status_code == 400 and "role" in bad_role.json()["errors"]
    again = member.client.post("/api/v1/invitations/accept", {"code": _invite(c)},
                               format="json")
    assert again.status_code == 409 and again.json()["code"] == "already_member"


# --- ownership --------------------------------------------------------------------------


def test_only_owners_grant_owner(owner, admin, member, team, make_caller):
    UserFactory(username="newbie")
    before = AuditLog.objects.count()
    granted = admin.client.patch("/api/v1/teams/acme/members/mia", {"role": "owner"},
                                 format="json")
    assert granted.status_code == 403 and granted.json()["code"] == "forbidden"
    added = admin.client.post("/api/v1/teams/acme/invitations", {"role": "owner"},
                              format="json")
    assert added.status_code == 403
    assert admin.client.patch("/api/v1/teams/acme/members/adam", {"role": "owner"},
                              format="json").status_code == 403  # not even to oneself
    assert role_of(team, "mia") == "member" and role_of(team, "newbie") is None
    assert role_of(team, "adam") == "admin"
    assert AuditLog.objects.count() == before

    assert owner.client.patch("/api/v1/teams/acme/members/mia", {"role": "owner"},
                              format="json").status_code == 200
    assert role_of(team, "mia") == "owner"
    newbie = make_caller(None, username="newbie2")
    assert newbie.client.post("/api/v1/invitations/accept",
                              {"code": _invite(owner.client, "owner")},
                              format="json").status_code == 201
    assert role_of(team, "newbie2") == "owner"


def test_admins_cannot_demote_or_remove_owners(owner, admin, make_caller, team):
    make_caller(team, Role.OWNER, "otto")  # two owners: "last owner" is not what stops it
    demoted = admin.client.patch("/api/v1/teams/acme/members/otto", {"role": "viewer"},
                                 format="json")
    assert demoted.status_code == 403, demoted.content
    removed = admin.client.delete("/api/v1/teams/acme/members/otto")
    assert removed.status_code == 403, removed.content
    assert role_of(team, "otto") == "owner"
    # An owner can.
    assert owner.client.patch("/api/v1/teams/acme/members/otto", {"role": "admin"},
                              format="json").status_code == 200
    assert role_of(team, "otto") == "admin"


def test_last_owner_cannot_be_demoted_or_removed(owner, team):
    demote = owner.client.patch("/api/v1/teams/acme/members/olivia", {"role": "admin"},
                                format="json")
    assert demote.status_code == 409 and demote.json()["code"] == "conflict"
    assert "owner" in demote.json()["message"]
    remove = owner.client.delete("/api/v1/teams/acme/members/olivia")
    assert remove.status_code == 409
    assert role_of(team, "olivia") == "owner"


def test_owner_can_step_down_once_there_is_another_owner(owner, make_caller, team):
    make_caller(team, Role.OWNER, "otto")
    assert owner.client.patch("/api/v1/teams/acme/members/olivia", {"role": "member"},
                              format="json").status_code == 200
    assert role_of(team, "olivia") == "member"
    assert Membership.objects.filter(team=team, role=Role.OWNER).count() == 1


def test_owner_can_remove_another_owner(owner, make_caller, team):
    make_caller(team, Role.OWNER, "otto")
    assert owner.client.delete("/api/v1/teams/acme/members/otto").status_code == 204
    assert role_of(team, "otto") is None


def test_removed_member_loses_access(admin, member, run):
    assert member.client.get("/api/v1/teams/acme/runs").status_code == 200
    assert admin.client.delete("/api/v1/teams/acme/members/mia").status_code == 204
    assert member.client.get("/api/v1/teams/acme/runs").status_code == 404


# --- teams ------------------------------------------------------------------------------


def test_creating_a_team_makes_the_caller_owner(make_caller):
    caller = make_caller(None, username="founder")
    response = caller.client.post("/api/v1/teams", {"slug": "newco", "name": "New Co"},
                                  format="json")
    assert response.status_code == 201
    assert response.json() == {**response.json(), "slug": "newco", "name": "New Co",
                               "role": "owner"}
    team = Team.objects.get(slug="newco")
    assert role_of(team, "founder") == "owner"
    assert caller.client.get("/api/v1/teams/newco").json()["role"] == "owner"
    assert ("team.create", "founder", "newco") in audit_actions(team)
    again = caller.client.post("/api/v1/teams", {"slug": "newco"}, format="json")
    assert again.status_code == 409
    bad = caller.client.post("/api/v1/teams", {"slug": "not a slug"}, format="json")
    assert bad.status_code == 400 and "slug" in bad.json()["errors"]


def test_teams_list_shows_only_my_teams_with_my_role(make_caller, team, other_team):
    zeta = Team.objects.create(slug="zeta", name="Zeta")
    caller = make_caller(team, Role.VIEWER, "vera")
    Membership.objects.create(team=zeta, user=caller.user, role=Role.ADMIN)
    make_caller(other_team, Role.OWNER, "rex")
    listed = caller.client.get("/api/v1/teams").json()
    assert [(t["slug"], t["role"]) for t in listed] == [("acme", "viewer"), ("zeta", "admin")]


def test_me_describes_the_caller(make_caller, team, other_team, worker):
    caller = make_caller(team, Role.MEMBER, "mo")
    Membership.objects.create(team=other_team, user=caller.user, role=Role.VIEWER)
    me = caller.client.get("/api/v1/me").json()
    assert me == {"kind": "user", "username": "mo", "teams": [
        {"slug": "acme", "name": team.name, "role": "member"},
        {"slug": "rival", "name": other_team.name, "role": "viewer"},
    ]}
    loner = make_caller(None, username="loner")
    assert loner.client.get("/api/v1/me").json()["teams"] == []
    as_worker = worker.get("/api/v1/me").json()
    assert as_worker["kind"] == "worker" and as_worker["team"] is None


# --- personal tokens --------------------------------------------------------------------


def test_personal_token_secret_is_shown_once_and_stored_hashed(make_caller):
    caller = make_caller(None, username="tess")
    created = caller.client.post("/api/v1/tokens", {"name": "ci"}, format="json")
    assert created.status_code == 201
    body = created.json()
    secret, prefix = body["token"], body["prefix"]
    assert secret.startswith(f"crc_{prefix}_") and len(secret) > 40
    assert body["kind"] == "personal" and body["active"] is True

    stored = ApiToken.objects.get(prefix=prefix)
    assert stored.key_hash != secret
    assert stored.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert stored.user == caller.user
    row = ApiToken.objects.filter(pk=stored.pk).values().get()
    assert not any(secret in str(value) for value in row.values())

    for url in ("/api/v1/tokens", f"/api/v1/tokens/{prefix}"):
        response = caller.client.get(url)
        assert response.status_code == 200
        assert secret not in response.content.decode()
        assert '"token"' not in response.content.decode()
        assert "key_hash" not in response.content.decode()
    listed = caller.client.get("/api/v1/tokens").json()["results"]
    assert prefix in [t["prefix"] for t in listed]

    # The new secret works on its own.
    assert client_for_token(secret).get("/api/v1/me").json()["username"] == "tess"


def test_tokens_of_others_are_invisible(make_caller):
    alice = make_caller(None, username="alice")
    bob = make_caller(None, username="bob")
    bob_prefix = ApiToken.objects.get(user=bob.user).prefix
    listed = alice.client.get("/api/v1/tokens").json()["results"]
    assert bob_prefix not in [t["prefix"] for t in listed]
    assert alice.client.get(f"/api/v1/tokens/{bob_prefix}").status_code == 404
    assert alice.client.delete(f"/api/v1/tokens/{bob_prefix}").status_code == 404
    assert ApiToken.objects.get(prefix=bob_prefix).revoked_at is None
    assert bob.client.get("/api/v1/me").status_code == 200


def test_expired_token_is_401_with_a_message(make_caller):
    caller = make_caller(None, username="ed")
    ApiToken.objects.filter(user=caller.user).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = caller.client.get("/api/v1/me")
    assert response.status_code == 401
    assert "expired" in response.json()["message"].lower()


def test_future_expiry_is_accepted(make_caller):
    caller = make_caller(None, username="fay")
    later = timezone.now() + timedelta(days=7)
    created = caller.client.post("/api/v1/tokens", {"name": "week",
                                                    "expires_at": later.isoformat()},
                                 format="json")
    assert created.status_code == 201
    assert client_for_token(created.json()["token"]).get("/api/v1/me").status_code == 200


def test_expiry_in_the_past_is_400(make_caller):
    caller = make_caller(None, username="pat")
    count = ApiToken.objects.count()
    past = (timezone.now() - timedelta(hours=1)).isoformat()
    response = caller.client.post("/api/v1/tokens", {"name": "old", "expires_at": past},
                                  format="json")
    assert response.status_code == 400
    assert "expires_at" in response.json()["errors"]
    assert ApiToken.objects.count() == count


def test_revoked_token_is_401(make_caller):
    caller = make_caller(None, username="rita")
    created = caller.client.post("/api/v1/tokens", {"name": "tmp"}, format="json").json()
    second = client_for_token(created["token"])
    assert second.get("/api/v1/me").status_code == 200
    assert caller.client.delete(f"/api/v1/tokens/{created['prefix']}").status_code == 204
    response = second.get("/api/v1/me")
    assert response.status_code == 401
    assert "revoked" in response.json()["message"].lower()
    detail = caller.client.get(f"/api/v1/tokens/{created['prefix']}").json()
    assert detail["active"] is False and detail["revoked_at"] is not None
    # Revoking one token leaves the others working.
    assert caller.client.get("/api/v1/me").status_code == 200


def test_last_used_at_is_set_on_use(make_caller):
    caller = make_caller(None, username="lou")
    token = ApiToken.objects.get(user=caller.user)
    assert token.last_used_at is None
    started = timezone.now()
    assert caller.client.get("/api/v1/me").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None and token.last_used_at >= started


@pytest.mark.parametrize("header", [
    "Bearer not-a-token",
    "Bearer crc_",
    "Bearer crc__secret",
    "Bearer xyz_abc_def",
    "Bearer crc_deadbeef0000_wrong-secret",
])
def test_malformed_or_unknown_token_is_401(header, db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/v1/me")
    assert response.status_code == 401
    assert response.json()["code"] in ("authentication_failed", "not_authenticated")


def test_right_prefix_wrong_secret_is_401(make_caller):
    caller = make_caller(None, username="wes")
    head, _, tail = caller.token.rpartition("_")
    forged = f"{head}_{'A' * len(tail)}"
    response = client_for_token(forged).get("/api/v1/me")
    assert response.status_code == 401
    assert response.json()["message"] == "Invalid token."


def test_inactive_users_token_is_401(make_caller):
    caller = make_caller(None, username="ina")
    caller.user.is_active = False
    caller.user.save(update_fields=["is_active"])
    assert caller.client.get("/api/v1/me").status_code == 401


# --- worker tokens ----------------------------------------------------------------------


def test_worker_token_format_and_secrecy(admin, team, run):
    created = admin.client.post("/api/v1/teams/acme/worker-tokens", {"name": "pool"},
                                format="json")
    assert created.status_code == 201
    body = created.json()
    secret, prefix = body["token"], body["prefix"]
    assert secret.startswith(f"crw_{prefix}_")
    assert body["kind"] == "worker" and body["team"] == "acme"
    stored = ApiToken.objects.get(prefix=prefix)
    assert stored.kind == TokenKind.WORKER and stored.team == team and stored.user is None
    assert stored.key_hash == hashlib.sha256(secret.encode()).hexdigest() != secret
    for url in ("/api/v1/teams/acme/worker-tokens",
                f"/api/v1/teams/acme/worker-tokens/{prefix}"):
        text = admin.client.get(url).content.decode()
        assert prefix in text and secret not in text and '"token"' not in text

    worker = client_for_token(secret)
    claim = worker.post("/api/v1/worker/claim", {"pool": run.pool, "worker_id": "w"},
                        format="json")
    assert claim.status_code == 200 and claim.json()["id"] == str(run.pk)

    assert admin.client.delete(f"/api/v1/teams/acme/worker-tokens/{prefix}").status_code == 204
    revoked = worker.post("/api/v1/worker/claim", {"pool": run.pool, "worker_id": "w"},
                          format="json")
    assert revoked.status_code == 401


def test_worker_token_list_shows_only_this_teams_worker_tokens(admin, outsider, other_team):
    admin.client.post("/api/v1/teams/acme/worker-tokens", {"name": "mine"}, format="json")
    outsider.client.post("/api/v1/teams/rival/worker-tokens", {"name": "theirs"},
                         format="json")
    listed = admin.client.get("/api/v1/teams/acme/worker-tokens").json()["results"]
    assert [t["name"] for t in listed] == ["mine"]  # no personal tokens, no rival tokens


def test_worker_token_expiry_in_the_past_is_400(admin):
    past = (timezone.now() - timedelta(minutes=5)).isoformat()
    response = admin.client.post("/api/v1/teams/acme/worker-tokens",
                                 {"name": "old", "expires_at": past}, format="json")
    assert response.status_code == 400


# --- audit ------------------------------------------------------------------------------


def test_membership_changes_are_audited(owner, admin, team, make_caller):
    newbie = make_caller(None, username="newbie")
    code = _invite(admin.client, "viewer")
    newbie.client.post("/api/v1/invitations/accept", {"code": code}, format="json")
    prefix = code.split("_")[1]
    admin.client.patch("/api/v1/teams/acme/members/newbie", {"role": "member"}, format="json")
    admin.client.delete("/api/v1/teams/acme/members/newbie")
    rows = AuditLog.objects.filter(team=team, target_type="user").order_by("pk")
    assert [(r.action, r.actor.username, r.actor_label, r.target_id, r.data) for r in rows] == [
        ("membership.add", "newbie", "newbie", "newbie", {"role": "viewer",
                                                          "invitation": prefix}),
        ("membership.role", "adam", "adam", "newbie", {"from": "viewer", "to": "member"}),
        ("membership.remove", "adam", "adam", "newbie", {}),
    ]


def test_token_changes_are_audited(admin, team, make_caller):
    caller = make_caller(None, username="tina")
    AuditLog.objects.all().delete()
    personal = caller.client.post("/api/v1/tokens", {"name": "ci"}, format="json").json()
    caller.client.delete(f"/api/v1/tokens/{personal['prefix']}")
    caller.client.delete(f"/api/v1/tokens/{personal['prefix']}")  # again: no second row
    worker = admin.client.post("/api/v1/teams/acme/worker-tokens", {"name": "pool"},
                               format="json").json()
    admin.client.delete(f"/api/v1/teams/acme/worker-tokens/{worker['prefix']}")
    rows = [(r.action, r.actor_label, r.team_id, r.target_id, r.data.get("kind"))
            for r in AuditLog.objects.order_by("pk")]
    assert rows == [
        ("token.create", "tina", None, personal["prefix"], "personal"),
        ("token.revoke", "tina", None, personal["prefix"], None),
        ("token.create", "adam", team.pk, worker["prefix"], "worker"),
        ("token.revoke", "adam", team.pk, worker["prefix"], None),
    ]
    assert not any(personal["token"] in str(r.data) or worker["token"] in str(r.data)
                   for r in AuditLog.objects.all())


def test_refused_changes_write_no_audit_rows(member, viewer, owner):
    before = AuditLog.objects.count()
    member.client.patch("/api/v1/teams/acme/members/victor", {"role": "admin"}, format="json")
    member.client.post("/api/v1/teams/acme/worker-tokens", {"name": "x"}, format="json")
    owner.client.delete("/api/v1/teams/acme/members/olivia")  # last owner: 409
    assert AuditLog.objects.count() == before
