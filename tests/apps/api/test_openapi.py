"""The OpenAPI document: served, valid, complete, warning-free; and the Swagger UI page."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from django.core.management import call_command
from django.test import Client
from django.utils.regex_helper import normalize
from drf_spectacular.drainage import reset_generator_stats
from openapi_spec_validator import validate

from tests.apps.api.test_urlconf import API_PREFIX, iter_routes

PUBLIC = {"schema", "docs"}




@pytest.fixture
def schema(member) -> dict:
    response = member.client.get("/api/v1/schema?format=json")
    assert response.status_code == 200, response.content[:300]
    return json.loads(response.content)


def _schema_path(route) -> str:
    """``api/v1/teams/%(team)s/runs/%(run)s`` -> ``/api/v1/teams/{team}/runs/{run}``."""
    (template, params), *_ = normalize(route.regex)
    return "/" + template % {p: f"{{{p}}}" for p in params}


def test_schema_is_served_as_yaml_by_default(member):
    response = member.client.get("/api/v1/schema")
    assert response.status_code == 200
    assert "openapi" in response["Content-Type"]
    document = yaml.safe_load(response.content)
    assert document["openapi"].startswith("3.")
    assert document["info"]["title"] == "Crucible API"


def test_schema_json_is_a_valid_openapi_document(schema):
    validate(schema)  # raises on any structural error
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    for expected in ("/api/v1/teams/{team}/runs/", "/api/v1/teams/{team}/runs/{run}/",
                     "/api/v1/teams/{team}/datasets/",
                     "/api/v1/teams/{team}/datasets/{dataset}/versions/",
                     "/api/v1/worker/claim", "/api/v1/worker/runs/{run}/metrics"):
        assert expected in paths, sorted(paths)
    assert "post" in paths["/api/v1/worker/claim"]
    assert {"get", "post"} <= set(paths["/api/v1/teams/{team}/runs/"])


def test_schema_publishes_the_worker_protocol(schema):
    """Every document of workers.protocol is a component, referenced by its endpoint."""
    from workers.protocol import PROTOCOL_MODELS

    components = schema["components"]["schemas"]
    for model in PROTOCOL_MODELS:
        assert {model.__name__, f"{model.__name__}Request"} & set(components), model.__name__
    claim = schema["paths"]["/api/v1/worker/claim"]["post"]
    assert claim["responses"]["200"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ClaimedRun"}


def test_schema_documents_every_routed_api_endpoint(schema):
    """A new endpoint that the schema generator cannot see (e.g. a plain function view)
    fails here rather than silently missing from the docs."""
    paths = {p.rstrip("/"): set(ops) for p, ops in schema["paths"].items()}
    missing = []
    for route in iter_routes():
        if not route.text.startswith(API_PREFIX) or route.name in PUBLIC:
            continue
        documented = paths.get(_schema_path(route).rstrip("/"))
        if documented is None or not set(route.methods) <= documented:
            missing.append((str(route), route.methods, documented))
    assert missing == []


def test_schema_declares_bearer_auth_on_operations(schema):
    schemes = schema["components"]["securitySchemes"]
    bearer = [name for name, s in schemes.items()
              if s.get("type") == "http" and s.get("scheme") == "bearer"]
    assert bearer, schemes
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method in ("get", "post", "put", "patch", "delete"):
                names = {name for entry in operation.get("security", []) for name in entry}
                assert bearer[0] in names, (method, path)


def test_schema_has_no_generated_collision_names(schema):
    """drf-spectacular falls back to hash-suffixed names (``Kind70eEnum``) on collisions;
    generated clients then get unstable type names."""
    odd = [n for n in schema["components"]["schemas"] if re.search(r"[0-9a-f]{3}Enum$", n)]
    assert odd == []


def test_spectacular_validate_fail_on_warn(tmp_path, db):
    reset_generator_stats()  # warnings are counted process-wide; count only this run
    target = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target))
    document = yaml.safe_load(target.read_text())
    assert "/api/v1/worker/claim" in document["paths"]


def test_docs_page_for_a_logged_in_user(owner):
    client = Client()
    client.force_login(owner.user)
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert "swagger" in html.lower()
    # The page's start-up code is a script file of its own (the CSP allows no inline
    # script), and it points Swagger UI at the schema.
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>\s*\S", html)
    init = next(s for s in re.findall(r'src="([^"]+)"', html) if "script" in s.split("?")[-1])
    assert "/api/v1/schema" in client.get(init.replace("&amp;", "&")).content.decode()
    # The UI's own assets are served locally (sidecar), not from a CDN.
    scripts = re.findall(r'src="([^"]+\.js)"', html)
    assert scripts and all(s.startswith("/") for s in scripts), scripts
    bundle = next(s for s in scripts if "swagger-ui-bundle" in s)
    asset = client.get(bundle)
    assert asset.status_code == 200
    body = b"".join(asset.streaming_content) if asset.streaming else asset.content
    assert len(body) > 100_000  # the real bundle, not an error page
