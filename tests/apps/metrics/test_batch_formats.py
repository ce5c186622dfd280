"""Metric batch bodies: rows or columns, JSON or msgpack, all store the same points once;
a malformed body of any kind is a 400 (413 when too large) that names the problem and stores
nothing."""

from __future__ import annotations

import math
import random
import struct

import msgpack
import orjson
import pytest

from apps.metrics.models import MetricBatch, MetricPoint, MetricRollup, MetricSeries
from tests.factories import DatasetFactory, make_run
from workers.client import metric_columns

URL = "/api/v1/worker/runs/{}/metrics"


@pytest.fixture
def leased(worker, project):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w"}).json()
    return run, {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}


def _points(seq: int) -> list[dict]:
    return [{"name": name, "step": seq * 10 + i, "value": math.sin(seq + i + k),
             "wall_time": 1.7e9 + i}
            for i in range(10) for k, name in enumerate(("loss", "kl", "reward"))]


def _send(worker, run, lease, body: bytes, content_type: str):
    return worker.generic("POST", URL.format(run.pk), body, content_type=content_type, **lease)


def _stored(run) -> list[tuple]:
    return list(MetricPoint.objects.filter(run=run).order_by("id")
                .values_list("name", "step", "value", "wall_time"))


ENCODINGS = {
    "json-rows": lambda seq, pts: (orjson.dumps({"seq": seq, "points": pts}),
                                   "application/json"),
    "json-columns": lambda seq, pts: (orjson.dumps({"seq": seq, "columns": metric_columns(pts)}),
                                      "application/json"),
    "msgpack-columns": lambda seq, pts: (msgpack.packb({"seq": seq,
                                                        "columns": metric_columns(pts)}),
                                         "application/msgpack"),
    "msgpack-rows": lambda seq, pts: (msgpack.packb({"seq": seq, "points": pts}),
                                      "application/msgpack"),
}


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_every_body_format_stores_the_same_points_once(worker, leased, encoding):
    run, lease = leased
    for seq in (1, 2, 1, 2):  # the second send of each seq is a retry
        body, content_type = ENCODINGS[encoding](seq, _points(seq))
        r = _send(worker, run, lease, body, content_type)
        assert r.status_code == 200, r.content
    expected = [(p["name"], p["step"], p["value"], p["wall_time"])
                for seq in (1, 2) for p in _points(seq)]
    assert _stored(run) == expected
    assert MetricBatch.objects.filter(run=run).count() == 2
    assert {s.name: s.count for s in MetricSeries.objects.filter(run=run)} == \
        {"loss": 20, "kl": 20, "reward": 20}
    bucket = MetricRollup.objects.get(run=run, name="kl", width=64, bucket=0)
    kl = [p for seq in (1, 2) for p in _points(seq) if p["name"] == "kl"]
    assert (bucket.count, bucket.last_step) == (20, 29)
    assert bucket.vmin == min(p["value"] for p in kl)
    assert bucket.vmax == max(p["value"] for p in kl)
    assert bucket.last_value == kl[-1]["value"]


def test_columns_without_wall_time_take_the_receive_time_and_ints_are_values(worker, leased):
    run, lease = leased
    body = {"seq": 1, "columns": {"name": ["a", "a"], "step": [0, 0], "value": [1, 2.5]}}
    assert _send(worker, run, lease, msgpack.packb(body), "application/msgpack") \
        .status_code == 200
    rows = _stored(run)
    assert [r[:3] for r in rows] == [("a", 0, 1.0), ("a", 0, 2.5)]
    assert all(r[3] > 1.7e9 for r in rows)
    # Two points at one step within a batch: the later one is the bucket's last.
    assert MetricRollup.objects.get(run=run, name="a", width=64, bucket=0).last_value == 2.5


def _deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\x01"  # fixarray of one, nested


BAD_BODIES: dict[str, tuple[bytes, str, str]] = {
    # name: (body, content type, words the message must hold)
    "empty msgpack": (b"", "application/msgpack", "metric batch is"),
    "truncated msgpack": (msgpack.packb({"seq": 1, "columns": {"name": ["a"]}})[:-3],
                          "application/msgpack", "msgpack parse error"),
    "two documents": (msgpack.packb({"seq": 1}) + msgpack.packb({"seq": 2}),
                      "application/msgpack", "more than one"),
    "invalid utf-8": (b"\x81\xa3seq\xa2\xff\xfe", "application/msgpack", "msgpack parse error"),
    "integer map key": (msgpack.packb({1: 2}), "application/msgpack", "msgpack parse error"),
    "binary string": (msgpack.packb({"seq": 1, "columns": {"name": [b"loss"], "step": [0],
                                                           "value": [1.0]}}),
                      "application/msgpack", "binary"),
    "extension type": (msgpack.packb({"seq": msgpack.ExtType(5, b"xx")}), "application/msgpack",
                       "extension type"),
    "timestamp": (b"\x82\xa3seq\xd6\xff" + struct.pack(">I", 5) + b"\xa6points\x90",
                  "application/msgpack", "timestamp"),
    "nested too deep": (_deep(200), "application/msgpack", "nested deeper"),
    "NaN value": (msgpack.packb({"seq": 1, "columns": {"name": ["a"], "step": [0],
                                                       "value": [math.nan]}}),
                  "application/msgpack", "finite"),
    "NUL in a name": (msgpack.packb({"seq": 1, "columns": {"name": ["a\x00"], "step": [0],
                                                           "value": [1.0]}}),
                      "application/msgpack", "NUL"),
    "not a map": (msgpack.packb([1, 2, 3]), "application/msgpack", "metric batch is"),
    "lengths differ": (msgpack.packb({"seq": 1, "columns": {"name": ["a", "b"], "step": [0],
                                                            "value": [1.0, 2.0]}}),
                       "application/msgpack", "same length"),
    "bool step": (msgpack.packb({"seq": 1, "columns": {"name": ["a", "a"], "step": [0, True],
                                                       "value": [1.0, 2.0]}}),
                  "application/msgpack", "columns.step[1]"),
    "negative step": (orjson.dumps({"seq": 1, "columns": {"name": ["a", "a"], "step": [0, -4],
                                                          "value": [1.0, 2.0]}}),
                      "application/json", "columns.step[1]"),
    "string value": (orjson.dumps({"seq": 1, "columns": {"name": ["a"], "step": [0],
                                                         "value": ["1.5"]}}),
                     "application/json", "columns.value[0]"),
    "huge int wall time": (b'{"seq": 1, "columns": {"name": ["a"], "step": [0], '
                           b'"value": [1], "wall_time": [1' + b"0" * 400 + b"]}}",
                           "application/json", "columns.wall_time[0]"),
    "empty name": (orjson.dumps({"seq": 1, "columns": {"name": ["a", ""], "step": [0, 1],
                                                       "value": [1.0, 2.0]}}),
                   "application/json", "columns.name[1]"),
    "unknown column": (orjson.dumps({"seq": 1, "columns": {"name": ["a"], "step": [0],
                                                           "value": [1.0], "tags": ["x"]}}),
                       "application/json", "unknown keys tags"),
    "missing column": (orjson.dumps({"seq": 1, "columns": {"name": ["a"], "value": [1.0]}}),
                       "application/json", "missing keys step"),
    "rows and columns": (orjson.dumps({"seq": 1, "points": [], "columns": {}}),
                         "application/json", "not both"),
    "empty columns": (orjson.dumps({"seq": 1, "columns": {"name": [], "step": [],
                                                          "value": []}}),
                      "application/json", "empty"),
    "bad seq": (msgpack.packb({"seq": "1", "columns": {"name": ["a"], "step": [0],
                                                       "value": [1.0]}}),
                "application/msgpack", "seq"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_bad_body_is_a_clear_400_that_stores_nothing(worker, leased, case):
    run, lease = leased
    body, content_type, words = BAD_BODIES[case]
    r = _send(worker, run, lease, body, content_type)
    assert r.status_code == 400, (case, r.status_code, r.content)
    assert words in r.json()["message"], r.json()
    assert not MetricPoint.objects.filter(run=run).exists()


def test_too_many_points_in_columns_is_413(worker, leased, settings):
    run, lease = leased
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MAX_METRIC_BATCH": 5}
    body = {"seq": 1, "columns": {"name": ["a"] * 6, "step": list(range(6)),
                                  "value": [1.0] * 6}}
    r = _send(worker, run, lease, msgpack.packb(body), "application/msgpack")
    assert r.status_code == 413 and "at most 5" in r.json()["message"]


def test_random_bytes_never_store_or_fail_with_500(worker, leased):
    """Fuzz-ish: random bytes and random corruptions of a valid msgpack batch are refused with
    a 4xx (or, when a corruption happens to leave a valid batch, stored): never a 500."""
    run, lease = leased
    rng = random.Random(25)
    valid = msgpack.packb({"seq": 7, "columns": metric_columns(_points(7))})
    bodies = [rng.randbytes(rng.randint(1, 64)) for _ in range(40)]
    for _ in range(60):
        corrupt = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        bodies.append(bytes(corrupt[: rng.randint(1, len(corrupt))]))
    for body in bodies:
        r = _send(worker, run, lease, body, "application/msgpack")
        assert r.status_code in (200, 400, 413), (body, r.status_code, r.content)
        if r.status_code == 400:
            assert r.json()["message"], r.content
    assert MetricBatch.objects.filter(run=run).exclude(seq=7).count() == 0


def test_metric_columns_fills_a_missing_wall_time():
    points = [{"name": "a", "step": 0, "value": 1.0, "wall_time": 5.0},
              {"name": "a", "step": 1, "value": 2.0}]
    columns = metric_columns(points)
    assert columns["name"] == ["a", "a"] and columns["step"] == [0, 1]
    assert columns["wall_time"][0] == 5.0 and columns["wall_time"][1] > 1.7e9
    assert "wall_time" not in metric_columns([{"name": "a", "step": 0, "value": 1.0}])
