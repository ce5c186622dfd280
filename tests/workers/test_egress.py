"""The allow-list rules themselves (workers/egress.py), resolution included (only
``localhost`` is looked up: no test resolves or reaches a name beyond this machine)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from workers import egress
from workers.egress import EgressRefused, EndpointAllow, check_model_path, parse_roots


@pytest.mark.parametrize(("rules", "url", "resolve", "ok"), [
    ("127.0.0.0/8", "http://127.0.0.1:8000/v1", True, True),
    ("127.0.0.0/8", "http://[::1]:8000/v1", True, False),
    ("::1/128", "http://[::1]:8000/v1", True, True),
    ("127.0.0.0/8", "http://localhost:8000/v1", True, True),  # resolves into the CIDR
    ("10.0.0.0/8", "http://localhost:8000/v1", True, False),  # resolves outside it
    ("localhost", "http://localhost:1/v1", True, True),  # listed by name
    ("localhost", "http://127.0.0.1:1/v1", True, False),  # a name does not allow its IP
    ("0.0.0.0/0", "http://169.254.169.254/", False, True),  # only an explicit CIDR allows it
    ("*.example.com", "https://a.b.example.com/v1", False, True),
    ("*.example.com", "https://example.com/v1", False, False),
    ("*.example.com", "https://evilexample.com/v1", False, False),
    ("", "http://127.0.0.1/v1", False, False),
    ("127.0.0.0/8", "file:///etc/passwd", False, False),
    ("127.0.0.0/8", "http:///nohost", False, False),
])
def test_endpoint_rules(rules, url, resolve, ok):
    allow = EndpointAllow.parse(rules)
    if ok:
        allow.check(url, resolve=resolve)
    else:
        with pytest.raises(EgressRefused):
            allow.check(url, resolve=resolve)


def test_a_listed_name_that_resolves_to_link_local_is_refused(monkeypatch):
    from workers import egress

    monkeypatch.setattr(egress, "_resolve", lambda host, port: [
        egress.ipaddress.ip_address("169.254.169.254")])
    allow = EndpointAllow.parse("models.example.com")
    allow.check("http://models.example.com/v1", resolve=False)  # the web, by name
    with pytest.raises(EgressRefused, match="169.254.169.254"):
        allow.check("http://models.example.com/v1", resolve=True)  # the worker, resolved


def test_model_roots(tmp_path: Path):
    root = tmp_path / "models"
    (root / "qwen").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    roots = parse_roots(f"{root}, relative/ignored")
    assert roots == (root.resolve(),)
    assert check_model_path(str(root / "qwen"), roots) == (root / "qwen").resolve()
    for bad in (str(root / ".." / "x"), str(root / "escape"), "relative", f"{root}-x"):
        with pytest.raises(EgressRefused):
            check_model_path(bad, roots)
    with pytest.raises(EgressRefused, match="none configured"):
        check_model_path(str(root / "qwen"), ())


# --- public-only URLs (alert webhooks) ----------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/h", "http://localhost:8000/h", "http://[::1]/h", "http://10.0.0.5/h",
    "http://172.16.3.4/h", "http://192.168.1.1/h", "http://100.64.0.1/h", "http://0.0.0.0/h",
    "http://[fc00::1]/h", "http://224.0.0.1/h",
])
def test_public_only_refuses_private_loopback_and_reserved(url: str) -> None:
    with pytest.raises(egress.EgressRefused, match="public hosts only|not an http"):
        egress.check_public_url(url)
    egress.check_public_url(url, allow_private=True)  # the operator's opt-in lets them by


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest", "http://[fe80::1]/x"])
def test_link_local_is_refused_even_with_private_allowed(url: str) -> None:
    with pytest.raises(egress.EgressRefused, match="link-local"):
        egress.check_public_url(url, allow_private=True)


def test_public_addresses_pass_and_odd_urls_do_not() -> None:
    assert [str(a) for a in egress.check_public_url("https://8.8.8.8/hook")] == ["8.8.8.8"]
    for bad in ("ftp://8.8.8.8/x", "https://u:p@8.8.8.8/x", "https://8.8.8.8:99999/x",
                "hook"):
        with pytest.raises(egress.EgressRefused):
            egress.check_public_url(bad)


def test_pinned_targets_keep_the_name_for_host_and_tls() -> None:
    from workers.egress import pinned_targets

    v4, v6 = ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("2606:2800:220:1::1")
    assert pinned_targets("https://Hooks.Example.com/a/b?x=1", [v4, v6]) == [
        ("https://93.184.216.34/a/b?x=1", "hooks.example.com", "hooks.example.com"),
        ("https://[2606:2800:220:1::1]/a/b?x=1", "hooks.example.com", "hooks.example.com")]
    assert pinned_targets("http://hooks.example.com:8080/h", [v4]) == [
        ("http://93.184.216.34:8080/h", "hooks.example.com:8080", "hooks.example.com")]
    assert pinned_targets("https://hooks.example.com:443/h", [v4])[0][1] == "hooks.example.com"
    assert pinned_targets("http://[2606:2800:220:1::1]:81/", [v6]) == [
        ("http://[2606:2800:220:1::1]:81/", "[2606:2800:220:1::1]:81", "2606:2800:220:1::1")]
