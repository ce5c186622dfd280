"""The OpenAPI document tells the truth: list shapes, nullable fields, the error responses
every operation can give, and query parameters that are validated rather than ignored.
(`make api-fuzz` holds the whole API to the schema; these pin the drift that was found.)"""

from __future__ import annotations

import json

import pytest

from tests.factories import DatasetFactory


@pytest.fixture
def schema(member) -> dict:
    return json.loads(member.client.get("/api/v1/schema?format=json").content)


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        node = schema["components"]["schemas"][name]
    return node


def _ok_body(schema: dict, path: str, method: str = "get") -> dict:
    responses = schema["paths"][path][method]["responses"]
    ok = next(v for k, v in responses.items() if k.startswith("2"))
    return _resolve(schema, ok["content"]["application/json"]["schema"])


def test_members_list_is_the_paginated_shape_it_documents(schema, member, viewer):
    documented = _ok_body(schema, "/api/v1/teams/{team}/members/")
    assert documented["type"] == "object" and "results" in documented["properties"]
    assert documented["properties"]["results"]["type"] == "array"
    body = member.client.get("/api/v1/teams/acme/members").json()
    assert set(body) == set(documented["properties"])
    assert sorted(m["username"] for m in body["results"]) == ["mia", "victor"]


def test_nullable_fields_are_declared_nullable(schema, member, project):
    token = _resolve(schema, {"$ref": "#/components/schemas/Token"})
    assert token["properties"]["team"].get("nullable") is True
    personal = member.client.get("/api/v1/tokens").json()["results"][0]
    assert personal["team"] is None  # what the schema now allows
    dataset = _resolve(schema, {"$ref": "#/components/schemas/Dataset"})
    current = dataset["properties"]["current_version"]
    assert current.get("nullable") is True or {"nullable": True} in current.get("allOf", [])
    DatasetFactory(project=project, team=project.team, slug="empty")
    assert member.client.get("/api/v1/teams/acme/datasets/empty").json()[
        "current_version"] is None


def test_every_operation_documents_its_error_responses(schema):
    error = schema["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"code", "message"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            missing = {"400", "401", "403", "404", "429"} - codes
            assert not missing, (method, path, missing)
            assert "Retry-After" in operation["responses"]["429"].get("headers", {})


@pytest.mark.parametrize("page_size", ["null", "0", "-1", "abc", "1001", "1.5"])
def test_bad_page_size_is_a_400_not_ignored(member, page_size):
    r = member.client.get("/api/v1/teams/acme/runs", {"page_size": page_size})
    assert r.status_code == 400, r.content
    assert "page_size" in r.json()["errors"]


def test_good_page_size_is_honoured_and_documented(schema, member, project):
    for n in range(3):
        member.client.post("/api/v1/teams/acme/projects", {"slug": f"p{n}"}, format="json")
    assert len(member.client.get("/api/v1/teams/acme/projects",
                                 {"page_size": "2"}).json()["results"]) == 2
    params = schema["paths"]["/api/v1/teams/{team}/projects/"]["get"]["parameters"]
    page_size = next(p for p in params if p["name"] == "page_size")
    assert page_size["schema"] == {"type": "integer", "minimum": 1, "maximum": 1000}


def test_plain_list_endpoints_are_documented_as_plain_lists(schema, member):
    """Found by the API fuzz run: the eval reports list is a bounded array, not a page."""
    path = "/api/v1/teams/{team}/environments/{environment}/versions/{version}/evals/"
    ok = schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["type"] == "array"
