"""A session's allow-listed egress proxy, with real sandboxes (bubblewrap, its own network
namespace) and real servers on the host: what a policy lets through, what it refuses and logs,
and that sessions without a policy keep no network at all.

The host's test servers listen on 127.0.0.1, which the proxy refuses by default (loopback):
the `open_manager` fixture opens 127.0.0.0/8 the way an operator would
(`CRUCIBLE_SESSION_EGRESS_OPEN`); `manager` keeps the default to show the refusal.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import socketserver
import threading
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from tests.skips import sandbox_unavailable
from workers.sandbox import egress_proxy
from workers.sandbox import sessions as S
from workers.sandbox.spec import EgressPolicy, SessionExec, SessionLimits, SessionStatus

SMALL = SessionLimits(memory_mb=256, disk_mb=32, pids=64, cpu_s=120, wall_s=600, idle_s=600)
PROXIED = {"NO_PROXY": "", "no_proxy": ""}  # the test servers are on 127.0.0.1: proxy it too
BIG = 2 << 20


class _Web(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        body = (b"x" * BIG if self.path == "/big" else
                json.dumps({"path": self.path, "host": self.headers["Host"]}).encode())
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data.upper())


@pytest.fixture(scope="module")
def web() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Web)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _manager(open_networks: tuple[str, ...]) -> Iterator[S.SessionManager]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    nets = egress_proxy.parse_networks(open_networks)
    with S.SessionManager(watch_every_s=0.05, egress_open=nets) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def open_manager() -> Iterator[S.SessionManager]:
    yield from _manager(("127.0.0.0/8",))


@pytest.fixture(scope="module")
def manager() -> Iterator[S.SessionManager]:
    yield from _manager(())


def _run(session: S.Session, cmd: str) -> S.ExecResult:
    return session.exec(SessionExec(cmd=cmd, env=PROXIED, timeout_s=60))


def _code(session: S.Session, url: str, *flags: str) -> tuple[str, str]:
    """(HTTP status, body) of curl fetching `url` through the env's proxy; the status is the
    proxy's answer to CONNECT where the tunnel was refused."""
    r = _run(session, f"curl -sS {' '.join(flags)} -w '\\n%{{http_code}} %{{http_connect}}' "
                      f"{url}")
    body, _, codes = r.stdout.decode().rpartition("\n")
    code, connect = codes.split()
    return (connect if code == "000" else code), body.rstrip("\n")


def test_allowed_host_through_the_env_proxy_and_the_log(open_manager: S.SessionManager,
                                                         web: int) -> None:
    policy = EgressPolicy(allow=[f"127.0.0.1:{web}"])
    with open_manager.create(SMALL, egress=policy) as s:
        # a forward request (plain http) and a CONNECT tunnel (curl -p), found through the
        # proxy variables the session's environment sets
        code, body = _code(s, f"http://127.0.0.1:{web}/plain?q=1")
        assert code == "200" and json.loads(body) == {"path": "/plain?q=1",
                                                       "host": f"127.0.0.1:{web}"}
        code, body = _code(s, f"http://127.0.0.1:{web}/tunnel", "-p")
        assert code == "200" and json.loads(body)["path"] == "/tunnel"
        r = _run(s, "python3 -c 'import urllib.request as u; "
                    f"print(u.urlopen(\"http://127.0.0.1:{web}/urllib\").read().decode())'")
        assert r.status == SessionStatus.OK and b'"/urllib"' in r.stdout, r
        log = s.egress_log()
    decisions = log["decisions"]
    assert [(d["verdict"], d["method"]) for d in decisions] == [
        ("allowed", "GET"), ("allowed", "CONNECT"), ("allowed", "GET")]
    assert all(d["host"] == "127.0.0.1" and d["port"] == web and d["address"] == "127.0.0.1"
               and d["rule"] == f"127.0.0.1:{web}" for d in decisions)
    assert all(d["bytes_up"] > 0 and d["bytes_down"] > 0 for d in decisions)
    assert log["stats"]["bytes"] == sum(d["bytes_up"] + d["bytes_down"] for d in decisions)


def test_a_tunnel_carries_any_tcp_to_an_allowed_port(open_manager: S.SessionManager,
                                                     echo: int) -> None:
    client = f"""
import socket
s = socket.create_connection(("127.0.0.1", {egress_proxy.PORT}))
s.sendall(b"CONNECT 127.0.0.1:{echo} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
s.sendall(b"ping through the tunnel")
s.shutdown(socket.SHUT_WR)
got = b""
while chunk := s.recv(4096):
    got += chunk
print(head.split(b"\\r\\n")[0].decode(), got.decode())
"""
    with open_manager.create(SMALL, egress=EgressPolicy(allow=[f"127.0.0.1:{echo}"])) as s:
        s.write("tunnel.py", client.encode())
        r = _run(s, "python3 tunnel.py")
        assert r.stdout == b"HTTP/1.1 200 Connection established PING THROUGH THE TUNNEL\n", r
        # the same tunnel to a port the rule does not name is refused
        other = echo + 1 if echo < 65535 else 1
        s.write("other.py", f"""
import socket
s = socket.create_connection(("127.0.0.1", {egress_proxy.PORT}))
s.sendall(b"CONNECT 127.0.0.1:{other} HTTP/1.1\\r\\n\\r\\n")
print(s.recv(100).split(b"\\r\\n")[0].decode())
""".encode())
        r = _run(s, "python3 other.py")
        assert r.stdout.startswith(b"HTTP/1.1 403 Forbidden"), r


def test_hosts_off_the_list_are_refused_with_the_rule_and_logged(
        open_manager: S.SessionManager, web: int) -> None:
    policy = EgressPolicy(allow=[f"127.0.0.1:{web}", "*.example.org:443"])
    with open_manager.create(SMALL, egress=policy) as s:
        code, body = _code(s, "http://pypi.org/simple/")
        assert code == "403"
        assert body == ("crucible egress proxy: refused: GET pypi.org:80: not on the session's "
                        f"allow-list (127.0.0.1:{web}, *.example.org:443)")
        code, _ = _code(s, "https://example.org/")  # the wildcard is strictly below the name
        assert code == "403"
        code, _ = _code(s, "http://a.example.org/")  # right name, wrong port (80)
        assert code == "403"
        code, _ = _code(s, f"http://127.0.0.2:{web}/")  # another address, same port
        assert code == "403"
        log = s.egress_log()["decisions"]
    assert [(d["verdict"], d["method"], d["host"], d["port"]) for d in log] == [
        ("refused", "GET", "pypi.org", 80), ("refused", "CONNECT", "example.org", 443),
        ("refused", "GET", "a.example.org", 80), ("refused", "GET", "127.0.0.2", web)]
    assert all(d["address"] is None and "allow-list" in d["reason"] for d in log)


def test_direct_connections_reach_nothing(open_manager: S.SessionManager, web: int) -> None:
    """With AF_INET allowed, the session's namespace still has only its own loopback: the
    host's services (PostgreSQL, Redis, the test server itself) and the outside are out of
    reach except through the proxy."""
    probe = ("import socket, sys\n"
             "for host, port in [('127.0.0.1', 5432), ('127.0.0.1', 6379), "
             f"('127.0.0.1', {web}), ('192.0.2.2', 5432), ('1.1.1.1', 80)]:\n"
             "    try:\n"
             "        socket.create_connection((host, port), 3)\n"
             "        print(host, port, 'CONNECTED')\n"
             "    except OSError as e:\n"
             "        print(host, port, e.errno)\n"
             "try:\n"
             "    socket.socket(socket.AF_INET6)\n"
             "except OSError as e:\n"
             "    print('inet6', e.errno)\n")
    with open_manager.create(SMALL, egress=EgressPolicy(allow=[f"127.0.0.1:{web}"])) as s:
        s.write("probe.py", probe.encode())
        out = _run(s, "python3 probe.py").stdout.decode()
        assert "CONNECTED" not in out
        assert f"127.0.0.1 5432 111\n127.0.0.1 6379 111\n127.0.0.1 {web} 111\n" in out
        assert "192.0.2.2 5432 101\n1.1.1.1 80 101\n" in out  # ENETUNREACH: no route out
        assert "inet6 97" in out  # EAFNOSUPPORT: only AF_INET is added
        # the proxy's port belongs to the host: a program cannot take it over
        r = _run(s, "python3 -c \"import socket; s = socket.socket(); "
                    f"s.bind(('127.0.0.1', {egress_proxy.PORT}))\"")
        assert r.status == SessionStatus.RE and b"Address already in use" in r.stderr
        assert _code(s, f"http://127.0.0.1:{web}/still")[0] == "200"


def test_sessions_without_a_policy_keep_no_network(manager: S.SessionManager) -> None:
    with manager.create(SMALL) as s:
        r = s.exec("python3 -c 'import socket; socket.socket(socket.AF_INET)'")
        assert r.status == SessionStatus.RE and b"Address family not supported" in r.stderr
        assert s.exec("env | grep -ci proxy").stdout == b"0\n"
        assert s.egress_log() == {"policy": None, "decisions": [], "stats": {}}
        # a fork of it has none either, and a fork of a policy session has none unless given
        snap = s.snapshot()
        with manager.fork(snap, SMALL) as fork:
            assert fork.exec("python3 -c 'import socket; socket.socket()'").status == "RE"
        manager.drop_snapshot(snap)


def test_private_and_loopback_addresses_are_refused_by_default(
        manager: S.SessionManager, web: int) -> None:
    """Names are resolved and checked on the host: `localhost` is on the list, but it resolves
    to loopback, which the default operator setting does not open. Rebinding cannot change
    that between check and connect: the proxy connects to the address it checked."""
    policy = EgressPolicy(allow=[f"localhost:{web}", "169.254.169.254:80", "10.1.2.3:80"])
    with manager.create(SMALL, egress=policy) as s:
        code, body = _code(s, f"http://localhost:{web}/")
        assert code == "403" and "resolves to 127.0.0.1, a loopback address" in body, body
        code, _ = _code(s, f"http://localhost:{web}/", "-p")  # curl hides a CONNECT's body
        assert code == "403"
        code, body = _code(s, "http://169.254.169.254/latest/meta-data/")
        assert code == "403" and "link-local" in body
        code, body = _code(s, "http://10.1.2.3/")
        assert code == "403" and "private" in body
        log = s.egress_log()["decisions"]
    assert [(d["verdict"], d["method"]) for d in log] == [
        ("refused", "GET"), ("refused", "CONNECT"), ("refused", "GET"), ("refused", "GET")]
    assert all(d["address"] is None for d in log)
    assert "loopback" in log[1]["reason"] and log[1]["rule"] == f"localhost:{web}"


def test_caps_connections_and_bytes(open_manager: S.SessionManager, web: int) -> None:
    policy = EgressPolicy(allow=[f"127.0.0.1:{web}"], max_connections=2, max_mb=1)
    hold = f"""
import socket, time
held = [socket.create_connection(("127.0.0.1", {egress_proxy.PORT})) for _ in range(2)]
time.sleep(0.5)
third = socket.create_connection(("127.0.0.1", {egress_proxy.PORT}))
print(third.recv(200).split(b"\\r\\n")[0].decode())
"""
    with open_manager.create(SMALL, egress=policy) as s:
        s.write("hold.py", hold.encode())
        assert _run(s, "python3 hold.py").stdout == b"HTTP/1.1 429 Too Many Requests\n"
        # 2 MiB against a 1 MiB quota: the transfer is cut, later requests are refused
        r = _run(s, f"curl -sS -o big http://127.0.0.1:{web}/big; stat -c %s big")
        assert int(r.stdout.split()[-1]) < BIG
        code, body = _code(s, f"http://127.0.0.1:{web}/small")
        assert code == "403" and "byte quota (1 MiB" in body
        log = s.egress_log()
    cut = [d for d in log["decisions"] if d["verdict"] == "allowed"]
    assert len(cut) == 1 and "cut" in cut[0]["reason"]
    assert log["stats"]["bytes"] > 1 << 20


def test_a_flood_of_refusals_keeps_the_record_of_connections(open_manager: S.SessionManager,
                                                              web: int) -> None:
    flood = f"""
import socket
for i in range({egress_proxy.LOG_KEPT + 100}):
    s = socket.create_connection(("127.0.0.1", {egress_proxy.PORT}))
    s.sendall(b"CONNECT evil%d.test:443 HTTP/1.1\\r\\n\\r\\n" % i)
    s.recv(100)
    s.close()
"""
    with open_manager.create(SMALL, egress=EgressPolicy(allow=[f"127.0.0.1:{web}"])) as s:
        assert _code(s, f"http://127.0.0.1:{web}/before")[0] == "200"
        s.write("flood.py", flood.encode())
        assert _run(s, "python3 flood.py").status == SessionStatus.OK
        log = s.egress_log()
    assert log["stats"]["decisions"] == egress_proxy.LOG_KEPT + 101
    assert len(log["decisions"]) == egress_proxy.LOG_KEPT + 1
    assert log["decisions"][0]["verdict"] == "allowed"  # the flood did not push it out
    assert log["decisions"][-1]["host"] == f"evil{egress_proxy.LOG_KEPT + 99}.test"


def test_forks_and_restores_keep_their_proxy(open_manager: S.SessionManager, web: int) -> None:
    policy = EgressPolicy(allow=[f"127.0.0.1:{web}"])
    with open_manager.create(SMALL, egress=policy) as s:
        snap = s.snapshot()
        with s.fork(snap) as fork:  # Session.fork keeps the parent's policy
            assert _code(fork, f"http://127.0.0.1:{web}/fork")[0] == "200"
            assert len(s.egress_log()["decisions"]) == 0  # each session has its own log
        s.restore(snap)  # a fresh agent in a fresh network namespace: the proxy follows
        assert _code(s, f"http://127.0.0.1:{web}/restored")[0] == "200"
        open_manager.drop_snapshot(snap)


def test_a_pre_started_sandbox_gets_its_proxy_when_forked(open_manager: S.SessionManager,
                                                           web: int) -> None:
    policy = EgressPolicy(allow=[f"127.0.0.1:{web}"])
    with open_manager.create(SMALL, egress=policy) as s:
        snap = s.snapshot()
        open_manager.keep_warm(SMALL, 2, egress=True)
        try:
            assert open_manager.wait_warm()
            blanks = list(open_manager._warm[open_manager._warm_key(SMALL, True)])
            # started with the policy's network, but no proxy until it is adopted
            r = _run(blanks[0], f"curl -sS http://127.0.0.1:{web}/early")
            assert r.status == SessionStatus.RE and b"Failed to connect" in r.stderr
            group = open_manager.fork_many(snap, 2, SMALL, egress=policy)
            try:
                assert group == blanks
                for f in group:
                    assert _code(f, f"http://127.0.0.1:{web}/adopted")[0] == "200"
                    assert _code(f, "http://pypi.org/")[0] == "403"
                    assert [d["verdict"] for d in f.egress_log()["decisions"]] == [
                        "allowed", "refused"]
            finally:
                for f in group:
                    f.close()
        finally:
            open_manager.keep_warm(SMALL, 0, egress=True)
        open_manager.drop_snapshot(snap)


def test_the_policy_is_validated_with_reasons() -> None:
    ok = EgressPolicy(allow=["PyPI.org.", "*.example.com:443", "10.0.0.1:8080", "::1",
                             "pypi.org"])
    assert ok.allow == ["pypi.org", "*.example.com:443", "10.0.0.1:8080", "[::1]"]
    assert ok.match("files.example.com", 443) and not ok.match("example.com", 443)
    assert ok.match("pypi.org", 80) and ok.match("pypi.org", 443)
    assert not ok.match("pypi.org", 8080)
    for bad, why in [([], "at least 1"), (["https://pypi.org"], "not a URL"),
                     (["*.com"], "two labels"), (["10.0.0.0/8"], "not a URL or a network"),
                     (["a..b"], "not a DNS name"), (["x:70000"], "1 to 65535"),
                     (["*.10.0.0.1"], "cannot cover an IP"), (["a*.b.com"], "not a DNS name")]:
        with pytest.raises(ValidationError, match=why):
            EgressPolicy(allow=bad)
    with pytest.raises(ValidationError, match="extra"):
        EgressPolicy.model_validate({"allow": ["a.com"], "deny": ["b.com"]})
    assert ipaddress.ip_address("127.0.0.1") in egress_proxy.parse_networks(["127.0.0.0/8"])[0]
