"""The session host: a process that keeps sandbox sessions for the control plane, over HTTP.

Sessions are processes and mounts of the process that made them (`--die-with-parent`), so they
need a host that outlives a request: this one (run as root on a sandbox node:
`python -m workers.sandbox.session_host --bind 127.0.0.1:8765`, with the shared secret in
`CRUCIBLE_SESSION_HOST_TOKEN`). The control plane (apps/sandbox/sessions.py) records sessions
per team, audits every call and forwards it here; this host trusts the token holder and knows
nothing of teams. Standard library HTTP (one thread per request; calls on one session are
serialised by the session itself).

Routes (JSON bodies; file bytes base64):
  POST   /sessions                      {"limits": {...}, "egress"?}  -> {"id"}
  GET    /sessions/<id>                                              -> {"id", "usage"}
  GET    /sessions/<id>/egress                                       -> the proxy's log
  DELETE /sessions/<id>
  POST   /sessions/<id>/exec            SessionExec                  -> exec result
  POST   /sessions/<id>/files           {"path", "data", "mode"}
  GET    /sessions/<id>/files?path=p                                 -> {"data"}
  GET    /sessions/<id>/list?path=p                                  -> {"entries"}
  POST   /sessions/<id>/snapshot                                     -> {"id", "bytes"}
  POST   /sessions/<id>/restore         {"snapshot"}
  POST   /snapshots/<id>/fork           {"limits": {...}, "egress"?}  -> {"id"}
  DELETE /snapshots/<id>
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import json
import os
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError

from . import sessions as S
from .spec import EgressPolicy, SessionExec, SessionLimits
from .wspath import PathRefused

MAX_BODY = 24 << 20


class HostError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _limits(body: dict[str, Any]) -> SessionLimits:
    return SessionLimits.model_validate(body.get("limits") or {})


def _egress(body: dict[str, Any]) -> EgressPolicy | None:
    """The session's egress policy (docs/sandbox.md, Egress); none: no network at all."""
    raw = body.get("egress")
    return None if raw is None else EgressPolicy.model_validate(raw)


class SessionHost:
    """The routes over one SessionManager."""

    def __init__(self, manager: S.SessionManager, token: str) -> None:
        self.manager = manager
        self.token = token

    def handle(self, method: str, path: str, query: dict[str, str],
               body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        parts = [p for p in path.split("/") if p]
        m = self.manager
        match (method, parts):
            case ("POST", ["sessions"]):
                return 201, {"id": m.create(_limits(body), egress=_egress(body)).id}
            case ("GET", ["sessions", sid]):
                return 200, {"id": sid, "usage": m.get(sid).usage()}
            case ("GET", ["sessions", sid, "egress"]):
                return 200, m.get(sid).egress_log()
            case ("DELETE", ["sessions", sid]):
                m.get(sid).close()
                return 200, {"closed": sid}
            case ("POST", ["sessions", sid, "exec"]):
                return 200, m.get(sid).exec(SessionExec.model_validate(body)).as_json()
            case ("POST", ["sessions", sid, "files"]):
                data = body.get("data", "")
                if not isinstance(data, str):
                    raise HostError(400, "data must be base64 text")
                try:
                    raw = base64.b64decode(data, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise HostError(400, "data must be base64 text") from exc
                mode = body.get("mode", 0o644)
                if not isinstance(mode, int) or not 0 <= mode <= 0o777:
                    raise HostError(400, "mode must be an integer permission (0..0o777)")
                m.get(sid).write(str(body.get("path", "")), raw, mode)
                return 200, {"path": body.get("path"), "bytes": len(raw)}
            case ("GET", ["sessions", sid, "files"]):
                got = m.get(sid).read(query.get("path", ""))
                return 200, {"data": base64.b64encode(got).decode()}
            case ("GET", ["sessions", sid, "list"]):
                entries = m.get(sid).list(query.get("path", ""))
                return 200, {"entries": [e.__dict__ for e in entries]}
            case ("POST", ["sessions", sid, "snapshot"]):
                snap_id = m.get(sid).snapshot()
                return 201, {"id": snap_id, "bytes": m.snapshot(snap_id).bytes}
            case ("POST", ["sessions", sid, "restore"]):
                m.get(sid).restore(str(body.get("snapshot", "")))
                return 200, {"restored": body.get("snapshot")}
            case ("POST", ["snapshots", snap_id, "fork"]):
                return 201, {"id": m.fork(snap_id, _limits(body), egress=_egress(body)).id}
            case ("DELETE", ["snapshots", snap_id]):
                m.drop_snapshot(snap_id)
                return 200, {"dropped": snap_id}
        raise HostError(404, f"no route {method} {path}")

    def respond(self, method: str, target: str, auth: str,
                raw: bytes) -> tuple[int, dict[str, Any]]:
        """Run one request, mapping every engine failure to a status and a message."""
        if not self.token or not hmac.compare_digest(auth, f"Bearer {self.token}"):
            return 401, {"message": "bad session host token"}
        url = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise HostError(400, "send a JSON object")
            return self.handle(method, url.path, query, body)
        except json.JSONDecodeError:
            return 400, {"message": "send a JSON object"}
        except HostError as exc:
            return exc.status, {"message": str(exc)}
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return 400, {"message": f"{where}: {err['msg']}"}
        except PathRefused as exc:
            return 400, {"message": str(exc)}
        except FileNotFoundError as exc:
            return 404, {"message": f"no such file: {exc.filename or query.get('path')}"}
        except S.SessionClosed as exc:
            return 410, {"message": str(exc), "reason": exc.reason}
        except S.UnknownSnapshot as exc:
            return 404, {"message": f"no snapshot {exc.args[0]!r}"}
        except (S.SessionError, OSError) as exc:
            return 503, {"message": f"the session host failed: {exc}"}


def serve(host: SessionHost, bind: tuple[str, int]) -> ThreadingHTTPServer:
    """A started server (on a daemon thread); `server_address` says the port."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _go(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                self._send(413, {"message": f"at most {MAX_BODY} bytes per request"})
                self.close_connection = True
                return
            raw = self.rfile.read(size) if size else b""
            status, payload = host.respond(self.command, self.path,
                                           self.headers.get("Authorization", ""), raw)
            self._send(status, payload)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(HTTPStatus(status))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _go

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
            return

    server = ThreadingHTTPServer(bind, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="session-host", daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="127.0.0.1:8765")
    args = parser.parse_args()
    token = os.environ.get("CRUCIBLE_SESSION_HOST_TOKEN", "")
    if not token:
        raise SystemExit("set CRUCIBLE_SESSION_HOST_TOKEN (the control plane sends it)")
    address, _, port = args.bind.rpartition(":")
    # SIGTERM (a supervisor's stop) unwinds like SIGINT, so the manager closes its sessions
    # and unmounts their layers on the way out instead of leaving them to the next sweep.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    S.sweep_orphans()
    try:
        with S.SessionManager() as manager:
            server = serve(SessionHost(manager, token), (address, int(port)))
            print(f"session host on {server.server_address}", flush=True)
            threading.Event().wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    print("session host stopped: its sessions are closed", flush=True)


if __name__ == "__main__":
    main()
