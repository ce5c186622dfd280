"""Input that used to raise a 500 (or drop a websocket) now gets the JSON error shape, or a
close frame with the RFC 6455 code, naming the problem; and nothing is half-written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from apps.datasets.models import DatasetVersion
from apps.projects.models import Project
from apps.runs.models import Run, RunEvent, Sample
from tests.factories import make_run, put_run_object

ROOT = Path(__file__).resolve().parents[3]
TEAM = "/api/v1/teams/acme"
W = "/api/v1/worker"


def _post_raw(client, path: str, body: bytes | str, **extra):
    return client.generic("POST", path, body, content_type="application/json", **extra)


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert isinstance(body.get("message"), str) and body["message"]
    if code is not None:
        assert body["code"] == code, body
    return body


@pytest.fixture
def running(worker, project, qa):
    run = make_run(project, qa)
    claimed = worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w",
                                         "run_id": str(run.pk)}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, **lease)
    return run, lease


# --- deep nesting ----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [70, 1_000, 5_000, 100_000])
def test_deeply_nested_json_is_a_400_naming_the_depth(member, qa, depth):
    deep = "[" * depth + "]" * depth
    r = _post_raw(member.client, f"{TEAM}/runs/preview",
                  '{"project": "main", "kind": "profile", "config": {"x": ' + deep + "}}")
    assert "nested deeper than" in _error(r, 400)["message"]
    r = _post_raw(member.client, f"{TEAM}/datasets/qa/versions",
                  '{"records": [{"a": ' + deep + "}]}")
    assert "nested deeper than" in _error(r, 400)["message"]


def test_the_depth_limit_is_exact_and_one_document_is_required(settings):
    from apps.core import jsonsafe

    limit = settings.CRUCIBLE["MAX_JSON_DEPTH"]
    assert jsonsafe.loads("[" * limit + "]" * limit) is not None
    with pytest.raises(jsonsafe.InvalidJSON, match="nested deeper"):
        jsonsafe.loads("[" * (limit + 1) + "]" * (limit + 1))
    with pytest.raises(jsonsafe.InvalidJSON, match="nested deeper"):
        jsonsafe.loads('{"a": ' * (limit + 1) + "1" + "}" * (limit + 1))
    for not_one in ("1, 2", "[1], [2]", "1]]", "", "  "):
        with pytest.raises(jsonsafe.InvalidJSON):
            jsonsafe.loads(not_one)
    assert jsonsafe.loads('{"a": "\\\\u0000"}') == {"a": "\\u0000"}  # an escaped backslash


def test_nesting_within_the_limit_is_fine(member, qa):
    value: object = "leaf"
    for _ in range(30):
        value = {"n": value}
    r = member.client.post(f"{TEAM}/datasets/qa/versions", {"records": [{"deep": value}]},
                           format="json")
    assert r.status_code == 201, r.content


def test_deep_jsonl_line_is_a_400_naming_the_line(member, qa):
    content = b'{"ok": 1}\n' + b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}\n"
    upload = SimpleUploadedFile("d.jsonl", content, "application/jsonl")
    r = member.client.post(f"{TEAM}/datasets/qa/versions", {"file": upload},
                           format="multipart")
    body = _error(r, 400)
    assert "Line 2" in body["message"] and "nested deeper" in body["message"]


# --- lone surrogates and NUL -----------------------------------------------------------------


def test_lone_surrogate_in_records_is_a_400_and_stores_nothing(member, qa):
    before = DatasetVersion.objects.count()
    r = _post_raw(member.client, f"{TEAM}/datasets/qa/versions",
                  '{"records": [{"prompt": "bad \\ud800 here"}]}')
    assert "surrogate" in _error(r, 400)["message"]
    upload = SimpleUploadedFile("d.jsonl", b'{"prompt": "x \\udc00"}\n', "application/jsonl")
    r = member.client.post(f"{TEAM}/datasets/qa/versions", {"file": upload},
                           format="multipart")
    assert "surrogate" in _error(r, 400)["message"]
    assert DatasetVersion.objects.count() == before
    # A proper pair is one character and fine.
    ok = _post_raw(member.client, f"{TEAM}/datasets/qa/versions",
                   '{"records": [{"prompt": "\\ud83d\\ude00"}]}')
    assert ok.status_code == 201, ok.content


def test_lone_surrogate_in_worker_batches_is_a_400(worker, running):
    run, lease = running
    r = _post_raw(worker, f"{W}/runs/{run.pk}/samples",
                  '{"samples": [{"step": 1, "prompt": "\\udfff", "completion": "c"}]}', **lease)
    assert "surrogate" in _error(r, 400)["message"]
    r = _post_raw(worker, f"{W}/runs/{run.pk}/events", '{"events": [{"message": "\\ud800"}]}',
                  **lease)
    _error(r, 400)
    r = _post_raw(worker, f"{W}/runs/{run.pk}/metrics",
                  '{"seq": 1, "points": [{"name": "\\ud800", "step": 1, "value": 1}]}', **lease)
    _error(r, 400)
    assert not Sample.objects.filter(run=run).exists()


def test_nul_in_json_fields_and_event_text_is_a_400_on_every_database(member, worker,
                                                                      running, qa):
    """PostgreSQL cannot store NUL in text or jsonb; SQLite can. Both refuse it, alike."""
    run, lease = running
    events = RunEvent.objects.filter(run=run).count()
    r = _post_raw(worker, f"{W}/runs/{run.pk}/events",
                  '{"events": [{"message": "a\\u0000b"}]}', **lease)
    body = _error(r, 400)
    assert "NUL" in body["message"] and "events[0].message" in body["message"]
    r = _post_raw(worker, f"{W}/runs/{run.pk}/events",
                  '{"events": [{"message": "ok", "data": {"k\\u0000": 1}}]}', **lease)
    assert "NUL" in _error(r, 400)["message"]
    assert RunEvent.objects.filter(run=run).count() == events
    r = _post_raw(member.client, f"{TEAM}/runs/preview",
                  '{"project": "main", "kind": "profile", "datasets": ["qa"], '
                  '"config": {"note": "x\\u0000"}}')
    assert "config.note" in _error(r, 400)["message"]
    r = _post_raw(member.client, f"{TEAM}/projects", '{"slug": "p2", "name": "a\\u0000"}')
    _error(r, 400)
    r = _post_raw(member.client, f"{TEAM}/datasets/qa/versions",
                  '{"records": [{"text": "\\u0000"}]}')
    _error(r, 400)
    assert not Project.objects.filter(slug="p2").exists()


# --- offsets and reports ---------------------------------------------------------------------


@pytest.mark.parametrize("offset", ["99999999999999999999999", str(2**63), "-1", "1e3", "x"])
def test_bad_record_offset_is_a_400(member, qa, offset):
    digest = qa.current_version.digest
    r = member.client.get(f"{TEAM}/datasets/qa/versions/{digest}/records",
                          {"offset": offset})
    assert "offset" in _error(r, 400)["message"]


def test_offset_past_the_end_is_an_empty_page(member, qa):
    digest = qa.current_version.digest
    r = member.client.get(f"{TEAM}/datasets/qa/versions/{digest}/records",
                          {"offset": str(2**63 - 1)})
    assert r.status_code == 200 and r.json()["records"] == []


@pytest.mark.parametrize("case", ["jsonl", "missing", "dotdot", "array", "binary"])
def test_unreadable_report_is_a_json_error_not_a_500(member, running, case):
    run, _ = running
    if case == "jsonl":
        uri = put_run_object(run, "report.jsonl", b'{"a": 1}\n{"a": 2}\n')
    elif case == "missing":
        uri = put_run_object(run, "gone.json", b"{}")
        Path(uri.removeprefix("file://")).unlink()
    elif case == "dotdot":
        uri = put_run_object(run, "r.json", b"{}").rsplit("/", 1)[0] + "/../../x.json"
    elif case == "array":
        uri = put_run_object(run, "r.json", b"[1, 2]")
    else:
        uri = put_run_object(run, "r.json", bytes(range(256)))
    Run.objects.filter(pk=run.pk).update(report_uri=uri)  # as a row from before the rule
    r = member.client.get(f"{TEAM}/runs/{run.pk}/report")
    expected = {"missing": 404, "dotdot": 409}.get(case, 409)
    _error(r, expected)


def test_options_on_worker_endpoints_is_a_405_not_a_500(worker, running):
    """Found by the API fuzz run: DRF's OPTIONS metadata looked for a serializer the worker
    views do not have."""
    run, lease = running
    for path in ("claim", "sweep", f"runs/{run.pk}/metrics", f"runs/{run.pk}/status",
                 "executions/0/start"):
        r = worker.options(f"{W}/{path}", **lease)
        assert r.status_code == 405, (path, r.content[:200])
        assert r.json()["code"] == "method_not_allowed"


# --- oversize bodies -------------------------------------------------------------------------


def test_body_over_the_upload_limit_is_a_json_413(member, project, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
    r = _post_raw(member.client, f"{TEAM}/projects", b'{"slug": "x", "name": "' +
                  b"y" * (2 * 1024 * 1024) + b'"}')
    body = _error(r, 413, "payload_too_large")
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in body["message"]
    assert not Project.objects.filter(slug="x").exists()


# --- websocket frames, through a real server -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@pytest.fixture
def web_server(transactional_db):
    """A uvicorn process serving config.asgi on the test database."""
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": _database_url(), "OMP_NUM_THREADS": "1",
           "DATA_UPLOAD_MAX_MEMORY_SIZE": str(1024 * 1024)}
    env.pop("REDIS_URL", None)  # frames are answered by the consumer itself
    web = subprocess.Popen([sys.executable, "-m", "uvicorn", "config.asgi:application",
                            "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert web.poll() is None, "the web process exited"
                assert time.monotonic() < deadline, "the web process did not start"
                time.sleep(0.2)
        yield port
    finally:
        web.terminate()
        web.wait(timeout=20)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("frame", "code", "error"), [
    (b"\x00\x01binary", 1003, "binary_frame"),
    ("not json at all", 1007, "invalid_json"),
    ("[" * 5000, 1007, "invalid_json"),
])
def test_bad_websocket_frames_get_an_error_and_a_close_code(web_server, member, project, qa,
                                                            frame, code, error):
    import websockets.sync.client as ws_client
    from websockets.exceptions import ConnectionClosed

    run = make_run(project, qa)
    url = f"ws://127.0.0.1:{web_server}/ws/teams/acme/runs/{run.pk}/stream?after=1"
    with ws_client.connect(url, additional_headers={
            "Authorization": f"Bearer {member.token}"}) as conn:
        conn.send(json.dumps({"type": "ping"}))
        assert json.loads(conn.recv(timeout=10))["type"] == "pong"
        conn.send(frame)
        message = json.loads(conn.recv(timeout=10))
        assert message["type"] == "error" and message["code"] == error
        assert message["message"]
        with pytest.raises(ConnectionClosed):
            conn.recv(timeout=10)
        assert conn.close_code == code


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_oversize_body_through_the_asgi_server_is_a_json_413(web_server, member, project):
    import httpx

    r = httpx.post(f"http://127.0.0.1:{web_server}{TEAM}/projects",
                   content=b'{"slug": "x", "name": "' + b"y" * (2 * 1024 * 1024) + b'"}',
                   headers={"Authorization": f"Bearer {member.token}",
                            "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["code"] == "payload_too_large"


def test_options_on_every_documented_path_is_never_a_500(owner, project):
    """Found by the API fuzz run on ``…/checkpoints/<id>/promote``: DRF's OPTIONS metadata
    asks a view for the serializer of its POST, and views whose actions parse their own
    bodies have none. Every path in the OpenAPI document, as the team's owner."""
    schema = owner.client.get("/api/v1/schema?format=json")
    assert schema.status_code == 200, schema.content[:200]
    paths = list(json.loads(schema.content)["paths"])
    assert len(paths) > 100
    failures = []
    for path in paths:
        if path.startswith("/api/v1/worker/"):
            continue
        concrete = path.replace("{team}", "acme")
        while "{" in concrete:  # any other id: one that does not exist
            start, end = concrete.index("{"), concrete.index("}")
            concrete = concrete[:start] + "0" + concrete[end + 1:]
        r = owner.client.options(concrete)
        if r.status_code >= 500:
            failures.append((path, r.status_code, r.content[:120]))
    assert failures == []


def test_the_openapi_document_describes_what_the_fuzz_run_caught_it_misdescribing(owner):
    """The usage document is one object, not an array; an alert rule's project is null when
    it watches every project; session calls document the 503 of an unreachable host."""
    doc = json.loads(owner.client.get("/api/v1/schema?format=json").content)
    usage = doc["paths"]["/api/v1/teams/{team}/usage/"]["get"]["responses"]["200"]
    assert usage["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TeamUsage"}
    assert doc["components"]["schemas"]["AlertRule"]["properties"]["project"]["nullable"]
    create = doc["paths"]["/api/v1/teams/{team}/sandbox-sessions/"]["post"]["responses"]
    assert "503" in create and "503" not in doc["paths"]["/api/v1/teams/{team}/usage/"]["get"][
        "responses"]
