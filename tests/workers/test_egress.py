"""The allow-list rules themselves (workers/egress.py), resolution included (only
``localhost`` is looked up: no test resolves or reaches a name beyond this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
