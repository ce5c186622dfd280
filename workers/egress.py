"""Allow-lists for what a run may make a worker reach: outbound endpoints (an eval policy's
or a synthesis generator's ``base_url``) and model directories (``base_model "path:…"``).

A launch names hosts and directories; the worker then connects to or reads them with its
own network position and files. Without a list a tenant could point a worker at cloud
metadata (``169.254.169.254``), an internal admin service or any directory the worker can
read. The web checks at launch (and refuses with the reason); the worker checks again
before it connects or loads, against its own environment, with the host resolved.

- ``CRUCIBLE_ENDPOINT_ALLOW``: comma-separated host names (``api.example.com``,
  ``*.example.com``) and CIDRs (``10.20.0.0/16``). A URL passes when its host is a listed
  name, or an IP literal inside a listed CIDR, or a name whose every address (resolved
  where resolution is asked for) lies inside one. Link-local addresses (cloud metadata)
  pass only through a CIDR that names them. Default: loopback only (the worker's own
  inference server, the embedded default's demo).
- ``CRUCIBLE_MODEL_PATH_ROOTS``: comma-separated absolute directories; a model path must
  lie inside one after resolving ``..`` and symlinks. Default: none (only presets and
  checkpoints of earlier runs; set it to offer model directories on the workers).

Plain Python (ipaddress, socket): both the web and the workers import it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_ENDPOINT_ALLOW = "127.0.0.0/8,::1/128,localhost"
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class EgressRefused(ValueError):
    """A URL or path outside the allow-list; the message says which rule refused it."""


@dataclass(frozen=True)
class EndpointAllow:
    names: tuple[str, ...] = ()
    networks: tuple[Network, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, raw: str) -> EndpointAllow:
        names, networks = [], []
        for item in (p.strip() for p in raw.split(",")):
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                names.append(item.lower().rstrip("."))
        return cls(tuple(names), tuple(networks))

    def describe(self) -> str:
        shown = [*self.names, *(str(n) for n in self.networks)]
        return ", ".join(shown) if shown else "nothing"

    def _name_allowed(self, host: str) -> bool:
        for name in self.names:
            if name.startswith("*.") and (host.endswith(name[1:]) and host != name[2:]):
                return True
            if host == name:
                return True
        return False

    def _address_allowed(self, address: Address) -> bool:
        return any(address in net for net in self.networks if net.version == address.version)

    def check(self, url: str, *, resolve: bool) -> None:
        """Raise EgressRefused unless ``url`` may be reached. ``resolve`` looks the host up
        (the worker does, right before connecting); without it a name that is not listed by
        name is refused unless it resolves here."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EgressRefused(f"{url[:200]!r} is not an http(s) URL with a host.")
        host = parts.hostname.lower().rstrip(".")
        allowed = self.describe()
        try:
            literal: Address | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            if self._address_allowed(literal):
                return
            raise EgressRefused(f"host {host} is not in CRUCIBLE_ENDPOINT_ALLOW ({allowed}).")
        named = self._name_allowed(host)
        if named and not resolve:
            return
        addresses = _resolve(host, parts.port) if (resolve or not named) else []
        if not addresses:
            if named:
                return  # listed by name and not resolvable here: the worker checks again
            raise EgressRefused(f"host {host} is not in CRUCIBLE_ENDPOINT_ALLOW ({allowed}) "
                                "and does not resolve to an allowed address.")
        for address in addresses:
            if self._address_allowed(address):
                continue
            if named and not any(address in net for net in LINK_LOCAL
                                 if net.version == address.version):
                continue
            raise EgressRefused(f"host {host} resolves to {address}, which "
                                f"CRUCIBLE_ENDPOINT_ALLOW ({allowed}) does not allow.")


def check_public_url(url: str, *, allow_private: bool = False) -> list[Address]:
    """Raise EgressRefused unless ``url`` is an http(s) URL whose host resolves only to
    public (globally routable) addresses; returns them. For URLs a tenant names that the
    web itself calls (alert webhooks): there the deny-list is of the operator's own
    network (loopback, private ranges, link-local cloud metadata, reserved ranges), where an
    allow-list of hosts could not be known in advance. ``allow_private`` lets private and
    loopback addresses through (tests, on-premises receivers), never link-local."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EgressRefused(f"{url[:200]!r} is not an http(s) URL with a host.")
    if parts.username or parts.password:
        raise EgressRefused("a webhook URL may not carry credentials (user:password@).")
    host = parts.hostname.lower().rstrip(".")
    try:
        port = parts.port
    except ValueError as exc:
        raise EgressRefused(f"{url[:200]!r} has an invalid port.") from exc
    try:
        addresses: list[Address] = [ipaddress.ip_address(host)]
    except ValueError:
        addresses = _resolve(host, port)
    if not addresses:
        raise EgressRefused(f"host {host} does not resolve.")
    for address in addresses:
        if address.is_global and not address.is_multicast:
            continue
        if any(address in net for net in LINK_LOCAL if net.version == address.version):
            raise EgressRefused(f"host {host} resolves to link-local {address} (cloud "
                                "metadata lives there); refused.")
        if not allow_private:
            raise EgressRefused(f"host {host} resolves to {address}, a private, loopback or "
                                "reserved address; webhooks go to public hosts only "
                                "(CRUCIBLE_WEBHOOK_ALLOW_PRIVATE lets an operator allow "
                                "them).")
    return addresses


def pinned_targets(url: str, addresses: Iterable[Address]) -> list[tuple[str, str, str]]:
    """(URL with the host replaced by the address, Host header, TLS server name) for each
    checked address, in order. Connecting to the address that was checked, rather than to
    the name, closes the window between check and connect in which a DNS answer with a
    short TTL could turn into a private address (DNS rebinding). The Host header and the
    TLS server name keep the original host, so virtual hosting and certificate checks are
    those of the name."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port
    host_header = host if port in (None, default) else f"{host}:{port}"
    if ":" in host:  # an IPv6 literal keeps its brackets in the Host header
        host_header = f"[{host}]" if port in (None, default) else f"[{host}]:{port}"
    out = []
    for address in addresses:
        literal = f"[{address}]" if address.version == 6 else str(address)
        netloc = literal if port is None else f"{literal}:{port}"
        out.append((parts._replace(netloc=netloc).geturl(), host_header, host))
    return out


def _resolve(host: str, port: int | None) -> list[Address]:
    try:
        infos = socket.getaddrinfo(host, port or 443, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    out: list[Address] = []
    for info in infos:
        try:
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        except ValueError:
            continue
        if address not in out:
            out.append(address)
    return out


def parse_roots(raw: str) -> tuple[Path, ...]:
    roots = []
    for item in (p.strip() for p in raw.split(",")):
        if item and os.path.isabs(item):
            roots.append(Path(os.path.realpath(item)))
    return tuple(roots)


def check_model_path(path: str, roots: Iterable[Path]) -> Path:
    """The resolved directory if ``path`` lies inside one of ``roots``, else EgressRefused."""
    roots = tuple(roots)
    if not os.path.isabs(path):
        raise EgressRefused(f"model path {path[:200]!r} must be absolute.")
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    shown = ", ".join(str(r) for r in roots) or "none configured"
    raise EgressRefused(f"model path {path[:200]} is not inside CRUCIBLE_MODEL_PATH_ROOTS "
                        f"({shown}).")


def endpoint_allow_from_env() -> EndpointAllow:
    return EndpointAllow.parse(os.environ.get("CRUCIBLE_ENDPOINT_ALLOW",
                                              DEFAULT_ENDPOINT_ALLOW))


def model_roots_from_env() -> tuple[Path, ...]:
    return parse_roots(os.environ.get("CRUCIBLE_MODEL_PATH_ROOTS", ""))


def resolve(host: str, port: int | None) -> list[Address]:
    """Every address ``host`` resolves to here (TCP), deduplicated, in answer order; [] when
    it does not resolve. For proxies that check a name and then connect to what they checked."""
    return _resolve(host, port)
