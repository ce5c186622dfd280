"""Small hardening rules: responses that carry a new secret are never cached; the
forwarded-protocol header is trusted only when the operator says a proxy sets it; a launch
refuses fields it does not know, at the top level as in its config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from apps.runs.models import Run
from tests.factories import DatasetFactory, make_version

ROOT = Path(__file__).resolve().parents[3]
RUNS = "/api/v1/teams/acme/runs"


def _no_store(response) -> None:
    cache_control = response.get("Cache-Control", "")
    assert "no-store" in cache_control, cache_control


def test_token_secrets_are_served_no_store(member, admin):
    personal = member.client.post("/api/v1/tokens", {"name": "ci"}, format="json")
    assert personal.status_code == 201 and personal.json()["token"].startswith("crc_")
    _no_store(personal)
    worker = admin.client.post("/api/v1/teams/acme/worker-tokens", {"name": "pool"},
                               format="json")
    assert worker.status_code == 201 and worker.json()["token"].startswith("crw_")
    _no_store(worker)
    browser = Client()
    browser.force_login(member.user)
    page = browser.post("/t/acme/team/", {"op": "token-create", "kind": "personal",
                                           "name": "laptop"})
    assert page.status_code == 201 and "crc_" in page.content.decode()
    _no_store(page)
    # Lists hold no secret and keep the default caching rules.
    assert "no-store" not in member.client.get("/api/v1/tokens").get("Cache-Control", "")


def _secure_seen(extra: dict[str, str], tmp_path: Path) -> dict:
    code = """
import django, json; django.setup()
from django.conf import settings
from django.test import RequestFactory
request = RequestFactory().get("/", HTTP_X_FORWARDED_PROTO="https")
print(json.dumps({"header": settings.SECURE_PROXY_SSL_HEADER, "secure": request.is_secure()}))
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "SECURE_PROXY_SSL_HEADER")}
    env.update({"CRUCIBLE_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings",
                **extra})
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_forwarded_proto_is_ignored_unless_a_trusted_proxy_is_configured(tmp_path):
    default = _secure_seen({}, tmp_path)
    assert default == {"header": None, "secure": False}  # a client cannot claim HTTPS
    behind = _secure_seen({"SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto"}, tmp_path)
    assert behind == {"header": ["HTTP_X_FORWARDED_PROTO", "https"], "secure": True}


@pytest.fixture
def qa(project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)
    return dataset


@pytest.mark.parametrize("path", [f"{RUNS}/preview", RUNS])
def test_launch_refuses_unknown_top_level_fields(member, qa, path):
    body = {"project": "main", "kind": "profile", "datasets": ["qa"], "evil": 1,
            "confg": {"x": 1}}
    r = member.client.post(path, body, format="json")
    assert r.status_code == 400, r.content
    errors = r.json()["errors"]
    assert errors == {"confg": ["unknown field"], "evil": ["unknown field"]}
    assert "unknown field" in r.json()["message"]
    assert not Run.objects.exists()
    del body["evil"], body["confg"]
    assert member.client.post(path, body, format="json").status_code in (200, 201)


def test_version_launch_refuses_unknown_fields_too(member, project):
    envs = "/api/v1/teams/acme/environments"
    member.client.post(envs, {"slug": "arith", "project": "main"}, format="json")
    member.client.post(f"{envs}/arith/versions",
                       {"spec": {"env": {"source": "builtin", "name": "arithmetic"}}},
                       format="json")
    r = member.client.post(f"{envs}/arith/versions/v1/qc", {"sneaky": True}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"sneaky": ["unknown field"]}
