"""The SDK (``workers.client.CrucibleClient``) against a real ASGI server over real URLs: file
uploads (JSONL and Parquet) in one call, preview results, samples by step, the metrics
cursor, the compare endpoint, the live stream with resume by seq across a dropped
connection, and ``manage.py token create``."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.datasets.models import DatasetVersion
from apps.teams.models import ApiToken
from tests.factories import DatasetFactory, ProjectFactory, make_run, make_version
from workers.client import ApiError, CrucibleClient

pytestmark = pytest.mark.django_db(transaction=True)
W = "/api/v1/worker"


class Server:
    """uvicorn in a thread of the test process (it shares the test database and the
    in-memory channel layer), stoppable and restartable on the same port."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        import uvicorn

        from config.asgi import application

        self.server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1",
                                                    port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(timeout=15)
        from config.asgi import django_http

        if hasattr(django_http, "close_connections"):  # its pool threads' connections
            django_http.close_connections()


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    srv.start()
    yield srv
    if srv.thread is not None and srv.thread.is_alive():
        srv.stop()


@pytest.fixture
def sdk(server, member, project) -> Iterator[CrucibleClient]:
    with CrucibleClient(server.url, member.token, retries=0) as client:
        yield client


@pytest.fixture
def running(worker, project):
    """A claimed, running run and the worker's lease header."""
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="qa"))
    body = worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w", "run_id": str(run.pk)},
                       format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": body["lease_id"]}
    assert worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"},
                       **lease).status_code == 200
    return run, lease


def _metrics(worker, run, lease, seq: int, steps: range) -> None:
    points = [{"name": "loss", "step": s, "value": 1.0 / (s + 1)} for s in steps]
    r = worker.post(f"{W}/runs/{run.pk}/metrics", {"seq": seq, "points": points},
                    format="json", **lease)
    assert r.status_code == 200, r.content


# --- datasets --------------------------------------------------------------------------------

def test_upload_a_jsonl_or_parquet_file_as_a_version_in_one_call(sdk, tmp_path) -> None:
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "prompt": f"reverse {w}", "answer": w[::-1]}
            for i, w in enumerate(["abc", "hello", "crucible"])]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The dataset does not exist yet: with a project, the one call creates it.
    v1 = sdk.upload_file("acme", "reverse", jsonl, project="main", message="from jsonl")
    assert (v1["number"], v1["record_count"], v1["message"]) == (1, 3, "from jsonl")
    assert sdk.get("teams/acme/datasets/reverse")["project"] == "main"

    # The same records as Parquet are the same content: the same version comes back.
    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    again = sdk.upload_file("acme", "reverse", parquet)
    assert again["digest"] == v1["digest"] and again["number"] == 1

    # Parquet types become JSON: timestamps as ISO text, decimals exact, nested structs,
    # lists and nulls as they are.
    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.table({
        "id": [1, 2],
        "at": pa.array([datetime.datetime(2026, 1, 2, 3, 4, 5), None], pa.timestamp("s")),
        "price": pa.array([decimal.Decimal("1.50"), decimal.Decimal("-2.25")],
                          pa.decimal128(5, 2)),
        "meta": [{"lang": "en", "n": 3}, {"lang": "fr", "n": 4}],
        "tags": [["a", "b"], []],
    }), typed)
    v2 = sdk.upload_file("acme", "reverse", typed, parents=["reverse@v1"], message="typed")
    assert v2["number"] == 2 and v2["parents"] == [v1["digest"]]
    records = sdk.get("teams/acme/datasets/reverse/versions/v2/records")["records"]
    assert records == [
        {"id": 1, "at": "2026-01-02T03:04:05", "price": "1.50", "meta": {"lang": "en", "n": 3},
         "tags": ["a", "b"]},
        {"id": 2, "at": None, "price": "-2.25", "meta": {"lang": "fr", "n": 4}, "tags": []}]


def test_bad_files_are_refused_with_the_row_and_column_and_store_nothing(sdk, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sdk.create_dataset("acme", "d", "main")
    nan = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"x": [1.0, float("nan")]}), nan)
    with pytest.raises(ApiError) as info:
        sdk.upload_file("acme", "d", nan)
    assert info.value.status == 400
    assert "Row 2, column 'x' holds nan" in info.value.message
    binary = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"blob": [b"\x00\x01"]}), binary)
    with pytest.raises(ApiError, match="column 'blob' is binary"):
        sdk.upload_file("acme", "d", binary)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(ApiError, match="cannot be read"):
        sdk.upload_file("acme", "d", broken)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ApiError, match="Line 2 is not valid JSON"):
        sdk.upload_file("acme", "d", bad_jsonl)
    assert not DatasetVersion.objects.exists()
    with pytest.raises(FileNotFoundError):
        sdk.upload_file("acme", "d", tmp_path / "missing.jsonl")
    with pytest.raises(ApiError) as missing:  # no project: a missing dataset stays missing
        sdk.upload_file("acme", "nope", bad_jsonl)
    assert missing.value.status == 404


# --- runs ------------------------------------------------------------------------------------

def test_preview_returns_the_validation_result_instead_of_raising(sdk, project) -> None:
    DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(project.team.datasets.get(slug="qa"))
    ok = sdk.preview("acme", project="main", kind="profile", datasets=["qa"], config={})
    assert ok["valid"] is True and ok["run"]["kind"] == "profile"
    bad = sdk.preview("acme", project="main", kind="profile", datasets=["qa"],
                      config={"progress_every": "x"})
    assert bad["valid"] is False and bad["code"] == "invalid"
    assert "config.progress_every" in bad["message"]
    unknown = sdk.preview("acme", project="main", kind="nope", config={})
    assert unknown["valid"] is False and unknown["errors"] == {"kind": ["unavailable kind 'nope'"]}
    # Not about the document: still an error.
    with pytest.raises(ApiError) as info:
        sdk.preview("rival", project="main", kind="profile", config={})
    assert info.value.status == 404


def test_samples_by_step_with_their_rl_fields(sdk, worker, running) -> None:
    run, lease = running
    rows = [{"step": s, "prompt": f"p{s}-{i}", "completion": "c", "reward": float(i),
             "reward_components": {"exact": float(i)}, "advantage": i - 0.5,
             "weight_version": s - 1, "finish_reason": "stop" if i else "length"}
            for s in (1, 2, 3) for i in (0, 1)]
    assert worker.post(f"{W}/runs/{run.pk}/samples", {"samples": rows}, format="json",
                       **lease).status_code == 201
    step2 = sdk.run_samples("acme", str(run.pk), step=2)
    assert [s["prompt"] for s in step2] == ["p2-0", "p2-1"]  # as generated
    assert step2[1] | {"id": None, "created_at": None} == {
        "id": None, "created_at": None, "step": 2, "prompt": "p2-1", "completion": "c",
        "reward": 1.0, "reward_components": {"exact": 1.0}, "advantage": 0.5,
        "weight_version": 1, "finish_reason": "stop", "filter": None}
    newest = sdk.run_samples("acme", str(run.pk), limit=3)
    assert [s["step"] for s in newest] == [3, 3, 2]
    assert sdk.run_samples("acme", str(run.pk), step=9) == []
    for bad in ("x", "-1"):
        with pytest.raises(ApiError) as info:
            sdk.get(f"teams/acme/runs/{run.pk}/samples", step=bad)
        assert info.value.status == 400 and "step" in info.value.message


def test_the_metrics_cursor_returns_only_points_after_a_step(sdk, worker, running) -> None:
    run, lease = running
    _metrics(worker, run, lease, 1, range(0, 10))
    first = sdk.run_metrics("acme", str(run.pk), names=["loss"], after_step=-1, max_points=4)
    [series] = first["series"]
    assert [p["step"] for p in series["points"]] == [0, 1, 2, 3]
    assert series["more"] and first["more"] and series["last_step"] == 3
    assert series["points"][1] == {"step": 1, "min": 0.5, "max": 0.5, "last": 0.5, "count": 1}
    seen = [p["step"] for p in series["points"]]
    cursor = series["last_step"]
    while True:  # poll until caught up
        page = sdk.run_metrics("acme", str(run.pk), names=["loss"], after_step=cursor,
                               max_points=4)["series"][0]
        seen += [p["step"] for p in page["points"]]
        cursor = page["last_step"]
        if not page["more"]:
            break
    assert seen == list(range(10))
    _metrics(worker, run, lease, 2, range(10, 12))
    tail = sdk.run_metrics("acme", str(run.pk), after_step=cursor)["series"]
    assert [p["step"] for p in tail[0]["points"]] == [10, 11] and not tail[0]["more"]
    idle = sdk.run_metrics("acme", str(run.pk), after_step=11)["series"][0]
    assert idle["points"] == [] and idle["last_step"] == 11
    with pytest.raises(ApiError, match="after_step must be an integer"):
        sdk.run_metrics("acme", str(run.pk), after_step="x")  # type: ignore[arg-type]
    # The downsampled read as parallel columns: the same buckets as the points layout.
    points = sdk.run_metrics("acme", str(run.pk), names=["loss"], max_points=5)
    columns = sdk.run_metrics("acme", str(run.pk), names=["loss"], max_points=5,
                              layout="columns")
    cols = columns["series"][0]["columns"]
    assert columns["layout"] == "columns" and sum(cols["count"]) == 12
    assert [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)] \
        == points["series"][0]["points"]


def test_compare_overlays_series_and_diffs_configs(sdk, worker, project, other_team) -> None:
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    a = make_run(project, dataset, name="a", config={"progress_every": 10, "top_values": 5})
    b = make_run(project, dataset, name="b", config={"progress_every": 20, "top_values": 5})
    for run, scale in ((a, 1.0), (b, 2.0)):
        lease = {"HTTP_X_CRUCIBLE_LEASE": worker.post(
            f"{W}/claim", {"pool": "cpu", "worker_id": "w", "run_id": str(run.pk)},
            format="json").json()["lease_id"]}
        points = [{"name": "loss", "step": s, "value": scale * s} for s in range(3)]
        if run is b:
            points.append({"name": "only_b", "step": 0, "value": 1.0})
        worker.post(f"{W}/runs/{run.pk}/metrics", {"seq": 1, "points": points},
                    format="json", **lease)
    body = sdk.compare_runs("acme", [str(a.pk), str(b.pk)])
    assert [r["name"] for r in body["runs"]] == ["a", "b"]
    series = {s["name"]: s["runs"] for s in body["metrics"]["series"]}
    assert set(series) == {"loss", "only_b"}
    assert [p["last"] for p in series["loss"][str(b.pk)]] == [0.0, 2.0, 4.0]
    assert list(series["only_b"]) == [str(b.pk)]
    assert body["config"]["differing"] == 1
    assert body["config"]["rows"] == [{"key": "progress_every", "differs": True,
                                       "values": {str(a.pk): 10, str(b.pk): 20}}]
    everything = sdk.compare_runs("acme", [str(a.pk), str(b.pk)], all_keys=True,
                                  names=["loss"])
    rows = {r["key"]: r for r in everything["config"]["rows"]}
    assert len(rows) == everything["config"]["keys"] > 1  # the frozen config, defaults filled
    assert rows["top_values"] == {"key": "top_values", "differs": False,
                                  "values": {str(a.pk): 5, str(b.pk): 5}}
    assert [s["name"] for s in everything["metrics"]["series"]] == ["loss"]
    assert body["reports"] == {"baseline": None, "rows": []}

    # A hostile tenant: another team's run is the same 404 as none; bad ids are 400s.
    theirs = make_run(ProjectFactory(team=other_team, slug="x"))
    with pytest.raises(ApiError) as info:
        sdk.compare_runs("acme", [str(a.pk), str(theirs.pk)])
    assert info.value.status == 404 and str(theirs.pk) in info.value.message
    for ids, words in (([], "Name the runs"), (["nope"], "not a run id"),
                       ([str(a.pk)] * 1 + [f"00000000-0000-0000-0000-{i:012d}"
                                           for i in range(11)], "At most 10")):
        with pytest.raises(ApiError) as info:
            sdk.compare_runs("acme", ids)
        assert info.value.status == 400 and words in info.value.message


def test_stream_resumes_by_seq_across_a_dropped_connection(server, sdk, worker, running) -> None:
    run, lease = running
    rid = str(run.pk)
    _metrics(worker, run, lease, 1, range(0, 3))
    got: list[dict] = []
    stream = sdk.stream("acme", rid, after=0, timeout=30)
    # Replay: the status events so far (queued, claimed, running), then the metric batch.
    while not got or got[-1]["type"] != "metrics":
        got.append(next(stream))
    assert [m["seq"] for m in got] == list(range(1, len(got) + 1))
    assert got[-1]["steps"] == [0, 1, 2]

    # The web process goes away; the worker keeps reporting; a new one comes up.
    server.stop()
    _metrics(worker, run, lease, 2, range(3, 5))
    reported = worker.post(f"{W}/runs/{run.pk}/events", {"events": [
        {"message": "halfway", "level": "info"}]}, format="json", **lease)
    assert reported.status_code == 201
    server.start()
    while got[-1].get("message") != "halfway":
        got.append(next(stream))
    # ... then live: the run finishes and the iterator ends after its final status.
    worker.post(f"{W}/runs/{run.pk}/status", {"status": "succeeded"}, format="json", **lease)
    got += list(stream)
    seqs = [m["seq"] for m in got]
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # no gap, nothing twice
    assert [m["steps"] for m in got if m["type"] == "metrics"] == [[0, 1, 2], [3, 4]]
    assert got[-1]["kind"] == "status" and got[-1]["data"]["status"] == "succeeded"
    # Resuming later from a seq replays exactly what came after it.
    later = list(sdk.stream("acme", rid, after=seqs[-3], timeout=30))
    assert [m["seq"] for m in later] == seqs[-2:]


def test_stream_of_a_foreign_run_is_not_found(sdk, outsider, server, running) -> None:
    run, _ = running
    with CrucibleClient(server.url, outsider.token, retries=0) as theirs, \
            pytest.raises(ApiError) as info:
        next(theirs.stream("acme", str(run.pk), timeout=10))
    assert info.value.status == 404


# --- a first token for scripts ----------------------------------------------------------------

def test_manage_py_token_create_gives_a_script_its_first_token(server, member) -> None:
    out = io.StringIO()
    call_command("token", "create", "--user", "mia", "--name", "ci", stdout=out)
    raw = out.getvalue().strip()
    assert raw.startswith("crc_")
    with CrucibleClient(server.url, raw, retries=0) as client:
        assert client.me()["username"] == "mia"
        assert [t["slug"] for t in client.get("teams")] == ["acme"]
    token = ApiToken.objects.get(name="ci")
    assert token.key_hash != raw and raw not in token.key_hash  # only the hash is kept
    listing = io.StringIO()
    call_command("token", "list", "--user", "mia", stdout=listing)
    assert f"crc_{token.prefix}_…  ci  active" in listing.getvalue()
    assert raw not in listing.getvalue()
    call_command("token", "revoke", token.prefix, stdout=io.StringIO())
    with CrucibleClient(server.url, raw, retries=0) as client, pytest.raises(ApiError) as info:
        client.me()
    assert info.value.status == 401
    expiring = io.StringIO()
    call_command("token", "create", "--user", "mia", "--expires-days", "7", stdout=expiring)
    assert ApiToken.objects.get(prefix=expiring.getvalue().split("_")[1]).expires_at
    for args, words in ((["--user", "ghost"], "No user 'ghost'"),
                        (["--user", "mia", "--expires-days", "0"], "at least 1"),
                        (["--user", "mia", "--name", "x" * 101], "1 to 100")):
        with pytest.raises(CommandError, match=words):
            call_command("token", "create", *args, stdout=io.StringIO())

