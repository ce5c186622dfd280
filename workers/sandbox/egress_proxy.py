"""The allow-listed egress proxy of a sandbox session: outbound HTTP(S) only to the hosts its
`EgressPolicy` names, decided and connected on the host.

A session with a policy keeps every namespace of one without (its network namespace has only
its own loopback; nothing routes out). The proxy's listening socket is made by the host *inside*
that namespace (the creating thread enters it with setns, binds 127.0.0.1:3128 and leaves), so
programs reach it as an ordinary TCP proxy (`HTTP_PROXY`), while the socket and everything
behind it belong to the host: a program in the session can connect to it, never close or
replace it, and there is no forwarder in the session to kill. The seccomp filter of such a
session allows AF_INET besides AF_UNIX (only loopback exists to use it on).

Per connection the proxy reads one request head (16 KiB, 10 s at most):
- `CONNECT host:port` (HTTPS, or any TCP through a tunnel) and absolute-URI forward requests
  (`GET http://host:port/path`) are checked against the allow-list by name and port;
- the name is resolved here and every address checked: private, loopback, link-local,
  reserved and multicast addresses, and the host's own addresses, are refused unless the
  operator opened a network that holds them (`open_networks`, for tests and on-premises
  mirrors);
- the proxy connects to the address it checked, never to the name again (no DNS rebinding
  between check and connect; `workers.egress.pinned_targets` keeps the Host header);
- the session's caps hold: connections open at once, bytes both ways over the session's life,
  an idle timeout per connection.
Anything else gets an HTTP error whose body names the rule that refused it, and every decision
(allowed, refused, failed; host, port, address, rule, bytes) is kept in the session's log.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from workers import egress

from .spec import EgressPolicy, normalise_host

PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PORT}"
HEAD_LIMIT = 16 << 10
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
LOG_KEPT = 2000
_CHUNK = 64 << 10
_CLONE_NEWNET = 0x40000000
_HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "proxy-authorization",
               "proxy-authenticate", "te", "trailer", "upgrade"}
_libc = ctypes.CDLL(None, use_errno=True)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class EgressError(RuntimeError):
    """The proxy could not be set up (the engine's failure, not the program's)."""


def session_env() -> dict[str, str]:
    """What a policy session's programs see: the proxy for http and https (both spellings:
    curl reads only the lower-case http_proxy), nothing proxied for the session's own loopback."""
    local = "localhost,127.0.0.1,::1"
    return {"HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL, "http_proxy": PROXY_URL,
            "https_proxy": PROXY_URL, "NO_PROXY": local, "no_proxy": local}


def open_networks_from_env() -> tuple[Network, ...]:
    """`CRUCIBLE_SESSION_EGRESS_OPEN`: comma-separated CIDRs the operator lets sessions reach
    although they are not public (a package mirror on the LAN; 127.0.0.0/8 in tests)."""
    raw = os.environ.get("CRUCIBLE_SESSION_EGRESS_OPEN", "")
    return parse_networks(p for p in raw.split(",") if p.strip())


def parse_networks(items: Iterable[str]) -> tuple[Network, ...]:
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a network (CIDR like 10.0.0.0/8)") from exc
    return tuple(out)


@dataclass
class Decision:
    """One request the proxy decided on; bytes are filled in as the connection runs."""

    at: float
    verdict: str  # allowed | refused | failed
    method: str
    host: str
    port: int
    address: str | None
    rule: str | None
    reason: str
    bytes_up: int = 0
    bytes_down: int = 0


class _Refused(Exception):
    def __init__(self, status: int, reason: str, verdict: str = "refused",
                 rule: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.verdict = verdict
        self.rule = rule  # the allow rule the host matched, where the address was refused


def _host_local(address: Address) -> bool:
    """Whether `address` is one of this host's own (binding to it succeeds only then)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def listener_in_netns(pid: int, port: int = PORT) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` in the network namespace of process `pid`.
    Made on a throwaway thread that enters the namespace and leaves it (setns is per thread);
    refused when `pid` shares this process's namespace (the proxy must never listen on the
    host's own loopback)."""
    out: list[socket.socket | BaseException] = []

    def work() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                os.close(own)
                raise
            try:
                if os.fstat(own).st_ino == os.fstat(target).st_ino:
                    raise EgressError(f"process {pid} shares the host's network namespace")
                if _libc.setns(target, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise EgressError(f"cannot enter the session's network namespace: "
                                      f"{os.strerror(err)}")
                try:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    try:
                        sock.bind(("127.0.0.1", port))
                        sock.listen(64)
                    except BaseException:
                        sock.close()
                        raise
                    out.append(sock)
                finally:
                    # if leaving fails, this thread ends here anyway: nothing else runs on it
                    _libc.setns(own, _CLONE_NEWNET)
            finally:
                os.close(own)
                os.close(target)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out.append(exc)

    t = threading.Thread(target=work, name="egress-listen", daemon=True)
    t.start()
    t.join()
    got = out[0] if out else EgressError("the listener thread ended without a result")
    if isinstance(got, BaseException):
        if isinstance(got, EgressError):
            raise got
        raise EgressError(f"cannot listen in the session's network namespace: {got}") from got
    return got


class EgressProxy:
    """One session's proxy: a listener in the session's network namespace, a thread per
    admitted connection (at most `max_connections`), the decision log."""

    def __init__(self, policy: EgressPolicy, *, open_networks: Sequence[Network] = (),
                 resolver: Callable[[str, int], list[Address]] = egress.resolve) -> None:
        self.policy = policy
        self.rules = policy.rules()
        self.open_networks = tuple(open_networks)
        self.max_bytes = policy.max_mb << 20
        self._resolve = resolver
        self._lock = threading.Lock()
        # connections made and refusals are kept apart, so a flood of refused requests cannot
        # push the record of where bytes went out of the log
        self._made: deque[Decision] = deque(maxlen=LOG_KEPT)
        self._refused: deque[Decision] = deque(maxlen=LOG_KEPT)
        self._logged = 0
        self._active: set[socket.socket] = set()
        self._bytes = 0
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def listen_in(self, pid: int) -> None:
        """(Re)start listening in `pid`'s network namespace (a restored session has a new one)."""
        self.stop_listening()
        self._stop = threading.Event()
        self._listener = listener_in_netns(pid)
        self._thread = threading.Thread(target=self._accept_loop,
                                        args=(self._listener, self._stop),
                                        name="egress-accept", daemon=True)
        self._thread.start()

    def stop_listening(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self._lock:
            active = list(self._active)
        for conn in active:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop_listening()

    # -- the log -----------------------------------------------------------------------------

    def log(self) -> list[dict[str, object]]:
        """The decisions, oldest first: the last LOG_KEPT connections made and the last
        LOG_KEPT refusals (`stats` counts them all)."""
        with self._lock:
            both = sorted([*self._made, *self._refused], key=lambda d: d.at)
            return [asdict(d) for d in both]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"decisions": self._logged, "bytes": self._bytes,
                    "open_connections": len(self._active), "max_bytes": self.max_bytes}

    def _record(self, decision: Decision) -> Decision:
        with self._lock:
            (self._made if decision.verdict == "allowed" else self._refused).append(decision)
            self._logged += 1
        return decision

    # -- serving -----------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                if stop.is_set():
                    return
                time.sleep(0.01)  # EMFILE and the like: do not spin
                continue
            with self._lock:
                full = len(self._active) >= self.policy.max_connections
                if not full:
                    self._active.add(conn)
            if full:  # answered here, without a thread: a flood costs no threads
                self._record(Decision(time.time(), "refused", "?", "", 0, None, None,
                                      f"{self.policy.max_connections} connections are open "
                                      "(the policy's max_connections)"))
                conn.setblocking(False)
                with contextlib.suppress(OSError):
                    conn.send(_response(429, "too many connections: the session's policy "
                                        f"allows {self.policy.max_connections} at once"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="egress-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            conn.settimeout(HEAD_TIMEOUT_S)
            try:
                head, rest = _read_head(conn)
            except _Refused as exc:
                self._record(Decision(time.time(), "refused", "?", "", 0, None, None,
                                      exc.reason))
                with contextlib.suppress(OSError):
                    conn.sendall(_response(exc.status, exc.reason))
                return
            except OSError:
                return
            req = _Request("?", "", 0)
            try:
                req = _parse(head)
                decision, upstream = self._admit(req.method, req.host, req.port)
            except _Refused as exc:
                self._record(Decision(time.time(), exc.verdict, req.method, req.host, req.port,
                                      None, exc.rule, exc.reason))
                with contextlib.suppress(OSError):
                    conn.sendall(_response(exc.status, f"{req.method} {req.host}:{req.port}: "
                                           f"{exc.reason}"))
                return
            if req.method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n"
                             b"Via: crucible-egress\r\n\r\n")
                first = rest
            else:
                first = req.upstream_head(ipaddress.ip_address(str(decision.address))) + rest
            if self._count(decision, len(first), up=True):
                self._relay(conn, upstream, first, decision)
        finally:
            with self._lock:
                self._active.discard(conn)
            if upstream is not None:
                upstream.close()
            conn.close()

    def _admit(self, method: str, host: str, port: int) -> tuple[Decision, socket.socket]:
        """Check one request; the decision (logged) and a connected upstream, or _Refused."""
        rule = next((r for r in self.rules if r.matches(host, port)), None)
        if rule is None:
            raise _Refused(403, f"not on the session's allow-list "
                                f"({', '.join(self.policy.allow)})")
        with self._lock:
            spent = self._bytes >= self.max_bytes
        if spent:
            raise _Refused(403, f"the session's byte quota ({self.policy.max_mb} MiB, the "
                                "policy's max_mb) is spent")
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = self._resolve(host, port)
        if not addresses:
            raise _Refused(502, f"{host} does not resolve", verdict="failed")
        for address in addresses:
            why = self._address_refused(address)
            if why:
                raise _Refused(403, f"{host} resolves to {address}, {why}; refused (rule "
                                    f"{rule} names the host, not the address)", rule=str(rule))
        last: OSError | None = None
        for address in addresses:  # connect to what was checked, never to the name again
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                sock.connect((str(address), port))
            except OSError as exc:
                sock.close()
                last = exc
                continue
            decision = self._record(Decision(time.time(), "allowed", method, host, port,
                                             str(address), str(rule), "on the allow-list"))
            return decision, sock
        raise _Refused(502, f"cannot connect to {host} ({', '.join(map(str, addresses))}): "
                            f"{last.strerror if last else 'no address'}", verdict="failed")

    def _address_refused(self, address: Address) -> str | None:
        """Why the proxy will not connect to `address`, or None when it may."""
        if any(address in net for net in self.open_networks if net.version == address.version):
            return None
        if address.is_link_local:
            return "a link-local address (cloud metadata lives there)"
        if address.is_loopback:
            return "a loopback address (the host's own services)"
        if not address.is_global or address.is_multicast:
            return "a private, reserved or multicast address"
        if _host_local(address):
            return "an address of the sandbox host itself"
        return None

    def _relay(self, client: socket.socket, upstream: socket.socket, first: bytes,
               decision: Decision) -> None:
        """Copy bytes both ways until the upstream has closed and its bytes are delivered
        (a client's half-close is passed on), the idle timeout passes or the session's byte
        quota is spent."""
        client.setblocking(False)
        upstream.setblocking(False)
        c, u = client.fileno(), upstream.fileno()
        to_client, to_up = bytearray(), bytearray(first)
        reading = {c: True, u: True}
        poller = select.poll()
        poller.register(c, 0)
        poller.register(u, 0)
        idle = float(self.policy.idle_timeout_s)
        last = time.monotonic()
        up_write_shut = False
        while reading[u] or to_client:
            poller.modify(c, (select.POLLIN if reading[c] and len(to_up) < _CHUNK else 0)
                          | (select.POLLOUT if to_client else 0))
            poller.modify(u, (select.POLLIN if reading[u] and len(to_client) < _CHUNK else 0)
                          | (select.POLLOUT if to_up else 0))
            ready = poller.poll(1000)
            if not ready:
                if time.monotonic() - last > idle or self._stop.is_set():
                    decision.reason += f"; closed after {self.policy.idle_timeout_s} s idle"
                    return
                continue
            last = time.monotonic()
            for fd, ev in ready:
                sock, out, inbox = ((client, to_client, to_up) if fd == c else
                                    (upstream, to_up, to_client))
                if ev & select.POLLERR:
                    return
                if ev & select.POLLOUT and out:
                    try:
                        del out[:sock.send(out)]
                    except BlockingIOError:
                        pass
                    except OSError:
                        return
                if ev & (select.POLLIN | select.POLLHUP):
                    if not reading[fd]:
                        if not ev & select.POLLIN:
                            return  # hung up both ways: nobody left to deliver to
                        continue
                    try:
                        data = sock.recv(_CHUNK)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return
                    if not data:
                        reading[fd] = False
                    elif not self._count(decision, len(data), up=fd == c):
                        return
                    else:
                        inbox += data
            if not reading[c] and not to_up and not up_write_shut:
                up_write_shut = True  # the client finished sending: pass the half-close on
                with contextlib.suppress(OSError):
                    upstream.shutdown(socket.SHUT_WR)

    def _count(self, decision: Decision, n: int, *, up: bool) -> bool:
        with self._lock:
            self._bytes += n
            if up:
                decision.bytes_up += n
            else:
                decision.bytes_down += n
            if self._bytes <= self.max_bytes:
                return True
            decision.reason = (f"cut: the session's byte quota ({self.policy.max_mb} MiB) is "
                               "spent")
            return False


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """The request head (up to the blank line) and what came after it."""
    buf = b""
    deadline = time.monotonic() + HEAD_TIMEOUT_S
    while b"\r\n\r\n" not in buf:
        if len(buf) > HEAD_LIMIT:
            raise _Refused(431, f"the request head is over {HEAD_LIMIT} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Refused(408, f"no complete request head within {HEAD_TIMEOUT_S:.0f} s")
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except TimeoutError as exc:
            raise _Refused(408, f"no complete request head within {HEAD_TIMEOUT_S:.0f} s") \
                from exc
        if not chunk:
            raise OSError(errno.ECONNRESET, "closed before a request")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    if len(head) > HEAD_LIMIT:
        raise _Refused(431, f"the request head is over {HEAD_LIMIT} bytes")
    return head, rest


def _split_host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65_535:
        raise _Refused(400, f"CONNECT needs host:port, not {text[:100]!r}")
    return host, int(port)


@dataclass
class _Request:
    method: str
    host: str  # normalised
    port: int
    target: str = ""  # a forward request's absolute URL
    path: str = ""
    headers: tuple[str, ...] = ()  # end-to-end headers, Host and hop-by-hop ones dropped

    def upstream_head(self, address: Address) -> bytes:
        """The head sent to the origin: origin-form path, the Host header of the name (via
        pinned_targets, as webhooks do), no keep-alive (one request per connection)."""
        _pinned, host_header, _sni = egress.pinned_targets(self.target, [address])[0]
        return "\r\n".join([f"{self.method} {self.path} HTTP/1.1", f"Host: {host_header}",
                             *self.headers, "Connection: close", "", ""]).encode("latin-1")


def _parse(head: bytes) -> _Request:
    """One proxy request: CONNECT host:port, or a forward request with an absolute URL."""
    line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _Refused(400, f"not an HTTP/1.x proxy request: {line[:100]!r}")
    method, target, _version = parts
    if not method.isalpha() or not method.isupper():
        raise _Refused(400, f"not an HTTP method: {method[:20]!r}")
    if method == "CONNECT":
        raw_host, port = _split_host_port(target)
        host = normalise_host(raw_host)
        if host is None:
            raise _Refused(400, f"{raw_host[:100]!r} is not a host name or an IP address")
        return _Request(method, host, port)
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise _Refused(400, "send an absolute http:// URL (a forward proxy request) or "
                            "CONNECT host:port (for https)")
    try:
        port = url.port or 80
    except ValueError as exc:
        raise _Refused(400, f"bad port in {target[:100]!r}") from exc
    if url.username or url.password:
        raise _Refused(400, "credentials in the URL are not forwarded")
    host = normalise_host(url.hostname)
    if host is None:
        raise _Refused(400, f"{url.hostname[:100]!r} is not a host name or an IP address")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    kept = tuple(h for h in header_lines
                 if h.split(":", 1)[0].strip().lower() not in (*_HOP_BY_HOP, "host"))
    return _Request(method, host, port, target, path, kept)


def _response(status: int, reason: str) -> bytes:
    phrase = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout",
              429: "Too Many Requests", 431: "Request Header Fields Too Large",
              502: "Bad Gateway"}.get(status, "Error")
    body = f"crucible egress proxy: refused: {reason}\n".encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            f"X-Crucible-Egress: refused\r\n\r\n").encode() + body
