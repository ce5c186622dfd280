"""Writes for sandbox sessions: every call is recorded against the team and audited, then
forwarded to the session host that keeps the workspace (workers/sandbox/session_host.py).

The control plane holds no workspace: a session is a record here and processes and mounts on
the host. The host is trusted with a shared secret; tenancy is decided here (a session or a
snapshot of another team is a 404 before anything reaches the host).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError

from apps.core import audit
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, DomainError, InvalidInput, NotFound
from apps.sandbox.models import SandboxSession, SandboxSnapshot
from apps.teams.models import Team
from workers.sandbox.spec import EgressPolicy, SessionExec, SessionLimits

MAX_FILE_BYTES = 16 << 20


class HostUnavailable(DomainError):
    status_code = 503
    code = "session_host_unavailable"


class SessionGone(Conflict):
    code = "session_closed"


class QuotaExceeded(DomainError):
    status_code = 429
    code = "quota_exceeded"


def _pydantic(exc: ValidationError, prefix: str = "") -> InvalidInput:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "") or "body"
    what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
    return InvalidInput(f"{where}: {what}")


def validate_limits(data: Any) -> SessionLimits:
    try:
        return SessionLimits.model_validate(data or {})
    except ValidationError as exc:
        raise _pydantic(exc) from exc


def validate_egress(data: Any) -> EgressPolicy | None:
    """A session's egress policy from a request body; None (no network) when absent."""
    if data is None:
        return None
    try:
        return EgressPolicy.model_validate(data)
    except ValidationError as exc:
        raise _pydantic(exc, "egress") from exc


def validate_exec(data: Any) -> SessionExec:
    try:
        return SessionExec.model_validate(data)
    except ValidationError as exc:
        raise _pydantic(exc) from exc


def _host(method: str, path: str, *, json: dict[str, Any] | None = None,
          params: dict[str, str] | None = None, timeout: float = 60.0,
          session: SandboxSession | None = None) -> dict[str, Any]:
    conf = settings.CRUCIBLE
    try:
        r = httpx.request(method, conf["SESSION_HOST_URL"].rstrip("/") + path, json=json,
                          params=params, timeout=timeout,
                          headers={"Authorization": f"Bearer {conf['SESSION_HOST_TOKEN']}"})
    except httpx.HTTPError as exc:
        raise HostUnavailable(f"The session host is unreachable: {exc}") from exc
    try:
        body = r.json()
    except ValueError:
        body = {}
    message = str(body.get("message", r.text[:200]))
    if r.status_code < 300:
        return dict(body)
    if r.status_code == 400:
        raise InvalidInput(message)
    if r.status_code == 404:
        raise NotFound(message)
    if r.status_code == 410:
        if session is not None:
            _mark_closed(session, str(body.get("reason", "closed")))
        raise SessionGone(f"Session {session.pk if session else ''} is closed "
                          f"({body.get('reason', 'closed')}).")
    raise HostUnavailable(f"The session host refused the call ({r.status_code}): {message}")


def _mark_closed(session: SandboxSession, reason: str) -> None:
    SandboxSession.objects.filter(pk=session.pk, state=SandboxSession.OPEN).update(
        state=SandboxSession.CLOSED, closed_reason=reason[:200], closed_at=timezone.now())
    session.state, session.closed_reason = SandboxSession.CLOSED, reason[:200]


def _open(session: SandboxSession) -> None:
    if session.state != SandboxSession.OPEN:
        raise SessionGone(f"Session {session.pk} is closed ({session.closed_reason}).")


def _check_quota(team: Team) -> None:
    quota = settings.CRUCIBLE["SESSION_QUOTA"]
    Team.objects.select_for_update().get(pk=team.pk)
    open_rows = SandboxSession.objects.filter(team=team, state=SandboxSession.OPEN)
    open_now = open_rows.count()
    if open_now >= quota:
        # The host closes sessions on its own (idle, lifetime, CPU quota); such records stay
        # open here until a call finds out: ask the host before refusing.
        for row in open_rows[:quota]:
            with contextlib.suppress(SessionGone, NotFound):
                _host("GET", f"/sessions/{row.engine_id}", session=row)
        open_now = open_rows.count()
    if open_now >= quota:
        raise QuotaExceeded(f"Team '{team.slug}' has {open_now} open sessions, its quota; "
                            "close one first.")


def create_session(*, actor: Actor, team: Team, limits: SessionLimits,
                   forked_from: SandboxSnapshot | None = None,
                   egress: EgressPolicy | None = None) -> SandboxSession:
    """Open a session (empty, or a fork of one of the team's snapshots); with `egress`, its
    programs reach the allow-listed hosts through the engine's proxy, without it nothing."""
    policy = egress.model_dump() if egress is not None else None
    body = {"limits": limits.model_dump(), "egress": policy}
    with transaction.atomic():
        _check_quota(team)
        if forked_from is None:
            engine = _host("POST", "/sessions", json=body)
        else:
            engine = _host("POST", f"/snapshots/{forked_from.engine_id}/fork", json=body)
        row = SandboxSession.objects.create(
            team=team, created_by=actor.user, engine_id=engine["id"],
            limits=limits.model_dump(), egress=policy, forked_from=forked_from)
        audit.record(actor=actor, action="sandbox.session.fork" if forked_from else
                     "sandbox.session.create", team_id=team.pk, target_type="sandbox_session",
                     target_id=row.pk, data={"limits": row.limits, "egress": policy,
                                             "forked_from":
                                             str(forked_from.pk) if forked_from else None})
    return row


def egress_log(*, session: SandboxSession) -> dict[str, Any]:
    """The session's egress decisions as the proxy logged them (host, port, address, rule,
    verdict, bytes): the audit trail of its network use."""
    _open(session)
    return _host("GET", f"/sessions/{session.engine_id}/egress", session=session)


def exec_in(*, actor: Actor, session: SandboxSession, request: SessionExec) -> dict[str, Any]:
    _open(session)
    result = _host("POST", f"/sessions/{session.engine_id}/exec",
                   json=request.model_dump(), timeout=request.timeout_s + 30, session=session)
    with transaction.atomic():
        SandboxSession.objects.filter(pk=session.pk).update(execs=session.execs + 1)
        audit.record(actor=actor, action="sandbox.session.exec", team_id=session.team_id,
                     target_type="sandbox_session", target_id=session.pk,
                     data={"cmd_sha256": hashlib.sha256(request.cmd.encode()).hexdigest(),
                           "cmd": request.cmd[:200], "status": result.get("status"),
                           "exit_code": result.get("exit_code")})
        if result.get("status") in ("CPU", "LOST"):
            _mark_closed(session, str(result.get("message", "")))
    return result


def write_file(*, actor: Actor, session: SandboxSession, path: Any, data: Any,
               mode: Any = 0o644) -> dict[str, Any]:
    _open(session)
    if not isinstance(path, str) or not isinstance(data, str):
        raise InvalidInput("Send {\"path\": text, \"data\": base64 text}.")
    if len(data) > MAX_FILE_BYTES * 4 // 3 + 4:
        raise InvalidInput(f"At most {MAX_FILE_BYTES} bytes per file.")
    out = _host("POST", f"/sessions/{session.engine_id}/files",
                json={"path": path, "data": data, "mode": mode}, session=session)
    audit.record(actor=actor, action="sandbox.session.write", team_id=session.team_id,
                 target_type="sandbox_session", target_id=session.pk,
                 data={"path": path[:300], "bytes": out.get("bytes")})
    return out


def read_file(*, session: SandboxSession, path: str) -> bytes:
    _open(session)
    out = _host("GET", f"/sessions/{session.engine_id}/files", params={"path": path},
                session=session)
    return base64.b64decode(out["data"])


def list_dir(*, session: SandboxSession, path: str) -> list[dict[str, Any]]:
    _open(session)
    return list(_host("GET", f"/sessions/{session.engine_id}/list", params={"path": path},
                      session=session)["entries"])


def snapshot(*, actor: Actor, session: SandboxSession) -> SandboxSnapshot:
    _open(session)
    out = _host("POST", f"/sessions/{session.engine_id}/snapshot", session=session,
                timeout=300)
    with transaction.atomic():
        row = SandboxSnapshot.objects.create(team_id=session.team_id, session=session,
                                             engine_id=out["id"], bytes=int(out["bytes"]))
        audit.record(actor=actor, action="sandbox.session.snapshot", team_id=session.team_id,
                     target_type="sandbox_snapshot", target_id=row.pk,
                     data={"session": str(session.pk), "bytes": row.bytes})
    return row


def restore(*, actor: Actor, session: SandboxSession, snap: SandboxSnapshot) -> None:
    _open(session)
    if snap.dropped:
        raise NotFound(f"No snapshot '{snap.pk}'.")
    _host("POST", f"/sessions/{session.engine_id}/restore", json={"snapshot": snap.engine_id},
          session=session, timeout=120)
    audit.record(actor=actor, action="sandbox.session.restore", team_id=session.team_id,
                 target_type="sandbox_session", target_id=session.pk,
                 data={"snapshot": str(snap.pk)})


def drop_snapshot(*, actor: Actor, snap: SandboxSnapshot) -> None:
    if snap.dropped:
        raise NotFound(f"No snapshot '{snap.pk}'.")
    with contextlib.suppress(NotFound):  # the host lost it (restarted): the record goes anyway
        _host("DELETE", f"/snapshots/{snap.engine_id}")
    with transaction.atomic():
        SandboxSnapshot.objects.filter(pk=snap.pk).update(dropped=True)
        audit.record(actor=actor, action="sandbox.snapshot.drop", team_id=snap.team_id,
                     target_type="sandbox_snapshot", target_id=snap.pk, data={})


def close_session(*, actor: Actor, session: SandboxSession) -> SandboxSession:
    if session.state == SandboxSession.OPEN:
        with contextlib.suppress(SessionGone):
            _host("DELETE", f"/sessions/{session.engine_id}", session=session)
        with transaction.atomic():
            _mark_closed(session, "closed")
            audit.record(actor=actor, action="sandbox.session.close", team_id=session.team_id,
                         target_type="sandbox_session", target_id=session.pk, data={})
    return session
