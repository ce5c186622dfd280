"""The sandbox sessions API against a real session host (real sandboxes, real HTTP on
loopback): lifecycle, files, snapshot/restore/fork, audit, and tenant isolation."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import pytest

from apps.core.models import AuditLog
from apps.sandbox.models import SandboxSession, SandboxSnapshot
from tests.apps.sandbox.served import serve_sessions

URL = "/api/v1/teams/acme/sandbox-sessions"
LIMITS = {"memory_mb": 256, "disk_mb": 32, "pids": 48, "cpu_s": 60}


@pytest.fixture(scope="module")
def host() -> Iterator[tuple[str, str]]:
    with serve_sessions() as served:
        yield served


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_lifecycle_files_snapshot_restore_fork(member, hosted) -> None:
    c = member.client
    r = c.post(URL, {"limits": LIMITS})
    assert r.status_code == 201, r.json()
    sid = r.json()["id"]
    assert c.post(f"{URL}/{sid}/files", {"path": "app/main.py",
                                         "data": _b64(b"print('v1')\n")}).status_code == 200
    r = c.post(f"{URL}/{sid}/exec", {"cmd": "python3 app/main.py; echo two > t"})
    assert r.status_code == 200 and r.json()["status"] == "OK"
    assert r.json()["stdout"] == "v1\n" and r.json()["exit_code"] == 0
    got = c.get(f"{URL}/{sid}/files", {"path": "t"}).json()
    assert base64.b64decode(got["data"]) == b"two\n"
    names = {e["name"] for e in c.get(f"{URL}/{sid}/list", {"path": ""}).json()["entries"]}
    assert names == {"app", "t"}

    snap = c.post(f"{URL}/{sid}/snapshot")
    assert snap.status_code == 201
    snap_id = snap.json()["id"]
    c.post(f"{URL}/{sid}/exec", {"cmd": "rm t && echo broken > app/main.py"})
    fork = c.post(f"{URL}/{sid}/fork", {"snapshot": snap_id})
    assert fork.status_code == 201 and fork.json()["forked_from"] == snap_id
    fid = fork.json()["id"]
    assert c.post(f"{URL}/{fid}/exec", {"cmd": "cat t"}).json()["stdout"] == "two\n"
    assert c.post(f"{URL}/{sid}/restore", {"snapshot": snap_id}).status_code == 200
    assert c.post(f"{URL}/{sid}/exec", {"cmd": "python3 app/main.py"}).json()["stdout"] == "v1\n"

    assert c.delete(f"{URL}/{fid}").json()["state"] == "closed"
    r = c.post(f"{URL}/{fid}/exec", {"cmd": "true"})
    assert r.status_code == 409 and "closed" in r.json()["message"]
    actions = set(AuditLog.objects.filter(target_id__in=[sid, fid, snap_id])
                  .values_list("action", flat=True))
    assert {"sandbox.session.create", "sandbox.session.write", "sandbox.session.exec",
            "sandbox.session.snapshot", "sandbox.session.fork", "sandbox.session.restore",
            "sandbox.session.close"} <= actions
    assert c.delete(f"/api/v1/teams/acme/sandbox-snapshots/{snap_id}").status_code == 204
    assert c.post(f"{URL}/{sid}/restore", {"snapshot": snap_id}).status_code == 404
    c.delete(f"{URL}/{sid}")


def test_bad_input_is_a_clear_4xx(member, hosted) -> None:
    c = member.client
    assert c.post(URL, {"limits": {"memory_mb": 1}}).status_code == 400
    r = c.post(URL, {"limits": {"colour": 1}})
    assert r.status_code == 400 and "unknown field" in r.json()["message"]
    sid = c.post(URL, {"limits": LIMITS}).json()["id"]
    try:
        assert c.post(f"{URL}/{sid}/exec", {"cmd": ""}).status_code == 400
        assert c.post(f"{URL}/{sid}/exec", {"cmd": "x", "timeout_s": -1}).status_code == 400
        for path in ("../etc/passwd", "/etc/passwd", "a/../../x"):
            r = c.get(f"{URL}/{sid}/files", {"path": path})
            assert r.status_code == 400, (path, r.json())
            r = c.post(f"{URL}/{sid}/files", {"path": path, "data": _b64(b"x")})
            assert r.status_code == 400
        assert c.post(f"{URL}/{sid}/files", {"path": "f", "data": "%%%"}).status_code == 400
        assert c.get(f"{URL}/{sid}/files", {"path": "missing"}).status_code == 404
        c.post(f"{URL}/{sid}/exec", {"cmd": "ln -s /etc/shadow s"})
        assert c.get(f"{URL}/{sid}/files", {"path": "s"}).status_code == 400
        assert c.post(f"{URL}/{sid}/restore", {"snapshot": "nope"}).status_code == 404
    finally:
        c.delete(f"{URL}/{sid}")


def test_viewer_reads_but_cannot_exec(member, viewer, hosted) -> None:
    sid = member.client.post(URL, {"limits": LIMITS}).json()["id"]
    try:
        assert viewer.client.get(f"{URL}/{sid}").status_code == 200
        assert viewer.client.post(f"{URL}/{sid}/exec", {"cmd": "true"}).status_code == 403
        assert viewer.client.post(URL, {}).status_code == 403
    finally:
        member.client.delete(f"{URL}/{sid}")


def test_other_teams_get_404_everywhere(member, outsider, hosted) -> None:
    sid = member.client.post(URL, {"limits": LIMITS}).json()["id"]
    snap_id = member.client.post(f"{URL}/{sid}/snapshot").json()["id"]
    mine = outsider.client.post("/api/v1/teams/rival/sandbox-sessions",
                                {"limits": LIMITS}).json()["id"]
    try:
        o = outsider.client
        for method, path, body in [
            ("get", f"{URL}/{sid}", None), ("post", f"{URL}/{sid}/exec", {"cmd": "id"}),
            ("get", f"{URL}/{sid}/files?path=x", None), ("delete", f"{URL}/{sid}", None),
            ("post", f"{URL}/{sid}/fork", {}),
            ("get", f"/api/v1/teams/rival/sandbox-sessions/{sid}", None),
            ("post", f"/api/v1/teams/rival/sandbox-sessions/{sid}/exec", {"cmd": "id"}),
            ("delete", f"/api/v1/teams/rival/sandbox-snapshots/{snap_id}", None),
            # another team's snapshot id, through the outsider's own session
            ("post", f"/api/v1/teams/rival/sandbox-sessions/{mine}/fork",
             {"snapshot": snap_id}),
            ("post", f"/api/v1/teams/rival/sandbox-sessions/{mine}/restore",
             {"snapshot": snap_id}),
        ]:
            r = getattr(o, method)(path, body) if body is not None else getattr(o, method)(path)
            assert r.status_code == 404, (method, path, r.status_code)
        assert o.get("/api/v1/teams/rival/sandbox-sessions").json()["results"][0]["id"] == mine
        assert SandboxSession.objects.get(pk=sid).state == "open"
        assert SandboxSnapshot.objects.filter(team__slug="rival").count() == 0
    finally:
        member.client.delete(f"{URL}/{sid}")
        outsider.client.delete(f"/api/v1/teams/rival/sandbox-sessions/{mine}")


def test_host_down_is_503_and_quota_429(member, settings) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SESSION_HOST_URL": "http://127.0.0.1:9",
                         "SESSION_HOST_TOKEN": "x"}
    r = member.client.post(URL, {"limits": LIMITS})
    assert r.status_code == 503 and "unreachable" in r.json()["message"]
    assert SandboxSession.objects.count() == 0
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SESSION_QUOTA": 0}
    assert member.client.post(URL, {"limits": LIMITS}).status_code == 429


def test_sessions_the_host_closed_free_the_quota(member, hosted, settings) -> None:
    c = member.client
    sid = c.post(URL, {"limits": {**LIMITS, "idle_s": 1}}).json()["id"]
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SESSION_QUOTA": 1}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the host's watchdog closes it after 1 s idle
        r = c.post(URL, {"limits": LIMITS})
        if r.status_code != 429:
            break
        time.sleep(0.5)
    assert r.status_code == 201, r.json()
    stale = c.get(f"{URL}/{sid}").json()
    assert stale["state"] == "closed" and "idle" in stale["closed_reason"]
    c.delete(f"{URL}/{r.json()['id']}")
