"""The sessions API's egress policy against a real session host (real sandboxes, real HTTP):
validation with the field named, the policy recorded and audited, forks inheriting it or
dropping it, and the proxy's decision log per session, team-scoped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apps.core.models import AuditLog
from apps.sandbox.models import SandboxSession
from tests.apps.sandbox.served import serve_sessions

URL = "/api/v1/teams/acme/sandbox-sessions"
LIMITS = {"memory_mb": 256, "disk_mb": 32, "pids": 48, "cpu_s": 60}
EGRESS = {"allow": ["pypi.org", "*.example.com:443"], "max_connections": 4}


@pytest.fixture(scope="module")
def host() -> Iterator[tuple[str, str]]:
    with serve_sessions(egress_open=()) as served:
        yield served


def test_egress_policy_create_log_fork_and_audit(member, hosted) -> None:
    c = member.client
    bad = c.post(URL, {"limits": LIMITS, "egress": {"allow": ["http://pypi.org"]}})
    assert bad.status_code == 400
    assert bad.json()["message"].startswith("egress.allow: Value error, allow[0]: "
                                            "'http://pypi.org': give a host")
    bad = c.post(URL, {"limits": LIMITS, "egress": {"allow": ["a.com"], "open": True}})
    assert bad.status_code == 400 and bad.json()["message"] == "egress.open: unknown field"
    assert not SandboxSession.objects.exists()

    r = c.post(URL, {"limits": LIMITS, "egress": EGRESS})
    assert r.status_code == 201, r.json()
    sid = r.json()["id"]
    assert r.json()["egress"]["allow"] == EGRESS["allow"]
    # a host off the list: the proxy answers 403 naming the rule, and logs it
    r = c.post(f"{URL}/{sid}/exec", {"cmd": "curl -sS http://evil.test/x"})
    assert r.json()["stdout"].startswith("crucible egress proxy: refused: GET evil.test:80: "
                                         "not on the session's allow-list")
    log = c.get(f"{URL}/{sid}/egress").json()
    assert log["policy"]["allow"] == EGRESS["allow"] and log["stats"]["decisions"] == 1
    assert [(d["verdict"], d["host"], d["port"]) for d in log["decisions"]] == [
        ("refused", "evil.test", 80)]

    fork = c.post(f"{URL}/{sid}/fork", {})  # inherits the parent's policy
    assert fork.status_code == 201 and fork.json()["egress"]["allow"] == EGRESS["allow"]
    r = c.post(f"{URL}/{fork.json()['id']}/exec", {"cmd": "echo $https_proxy"})
    assert r.json()["stdout"] == "http://127.0.0.1:3128\n"
    bare = c.post(f"{URL}/{sid}/fork", {"egress": None})  # or drops it: no network at all
    assert bare.status_code == 201 and bare.json()["egress"] is None
    r = c.post(f"{URL}/{bare.json()['id']}/exec",
               {"cmd": "python3 -c 'import socket; socket.socket()'"})
    assert r.json()["status"] == "RE" and "Address family not supported" in r.json()["stderr"]
    assert c.get(f"{URL}/{bare.json()['id']}/egress").json()["decisions"] == []

    audits = {a.action: a.data for a in AuditLog.objects.filter(target_id=sid)}
    assert audits["sandbox.session.create"]["egress"]["allow"] == EGRESS["allow"]
    forked = AuditLog.objects.get(target_id=bare.json()["id"], action="sandbox.session.fork")
    assert forked.data["egress"] is None
    for s in (sid, fork.json()["id"], bare.json()["id"]):
        c.delete(f"{URL}/{s}")


def test_another_teams_egress_log_is_a_404(member, outsider, hosted) -> None:
    r = member.client.post(URL, {"limits": LIMITS, "egress": EGRESS})
    assert r.status_code == 201
    sid = r.json()["id"]
    got = outsider.client.get(f"/api/v1/teams/acme/sandbox-sessions/{sid}/egress")
    assert got.status_code == 404
    member.client.delete(f"{URL}/{sid}")
