"""Pure unit tests of the profile engine's statistics: no database, no object store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.profile.engine import profile_records
from workers.profile.spec import ProfileConfig
from workers.profile.stats import FieldStats, Profile, json_type
from workers.reporting import NullReporter, Stopped


class ListSink(NullReporter):
    def __init__(self, stop_after: int | None = None) -> None:
        self.metrics_calls: list[tuple[int, dict[str, float]]] = []
        self.events: list[tuple[str, dict[str, Any] | None]] = []
        self.stop_after = stop_after
        self.asked = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics_calls.append((step, metrics))

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((message, data))

    def should_stop(self) -> bool:
        self.asked += 1
        return self.stop_after is not None and self.asked > self.stop_after


def lines(records: list[Any]) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in records]


# --- json_type -------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "kind"), [
    (None, "null"), (True, "boolean"), (False, "boolean"), (0, "integer"), (1.5, "number"),
    ("", "string"), ([], "array"), ({}, "object"),
])
def test_json_type(value, kind):
    assert json_type(value) == kind


# --- FieldStats ------------------------------------------------------------------------------


def test_field_stats_strings():
    stats = FieldStats()
    for value in ["x", "yy", "x", "", "x", None]:
        stats.add(value)
    out = stats.summary(records=8, top_values=2)
    assert out["types"] == {"null": 1, "string": 5}
    assert out["present"] == 6
    assert out["missing"] == 2
    assert out["nulls"] == 1
    assert out["null_or_missing"] == 3
    assert out["distinct"] == 3  # "x", "yy", ""
    assert out["duplicates"] == 2  # 5 non-null values, 3 distinct
    assert out["length"] == {"min": 0, "max": 2, "mean": 1.0}  # (1+2+1+0+1)/5
    assert out["top"] == [{"value": "x", "count": 3}, {"value": "yy", "count": 1}]


def test_field_stats_numbers_have_no_length_or_top():
    stats = FieldStats()
    for value in [1, 1, 2.5, True, 1.0]:
        stats.add(value)
    out = stats.summary(records=5, top_values=5)
    assert out["types"] == {"boolean": 1, "integer": 2, "number": 2}
    # 1, 1.0 and true are different JSON values.
    assert out["distinct"] == 4
    assert out["duplicates"] == 1
    assert out["missing"] == 0 and out["nulls"] == 0
    assert "length" not in out
    assert "top" not in out


def test_field_stats_lists_and_objects_have_lengths():
    stats = FieldStats()
    for value in [[1, 2, 3], [], {"a": 1, "b": 2}, [3, 2, 1], {"b": 2, "a": 1}]:
        stats.add(value)
    out = stats.summary(records=5, top_values=5)
    assert out["length"] == {"min": 0, "max": 3, "mean": 2.0}  # (3+0+2+3+2)/5
    # Key order does not make objects distinct; element order makes lists distinct.
    assert out["distinct"] == 4
    assert out["duplicates"] == 1
    assert out["types"] == {"array": 3, "object": 2}
    assert "top" not in out


def test_field_stats_long_strings_are_not_top_values():
    stats = FieldStats()
    long = "z" * 201
    for value in [long, long, "short"]:
        stats.add(value)
    out = stats.summary(records=3, top_values=5)
    assert out["top"] == [{"value": "short", "count": 1}]
    assert out["distinct"] == 2 and out["duplicates"] == 1
    assert out["length"] == {"min": 5, "max": 201, "mean": round(407 / 3, 3)}


def test_field_stats_top_values_limit_and_zero():
    stats = FieldStats()
    for value in "aaabbc":
        stats.add(value)
    assert stats.summary(3, top_values=1)["top"] == [{"value": "a", "count": 3}]
    assert [t["value"] for t in stats.summary(6, top_values=10)["top"]] == ["a", "b", "c"]
    assert "top" not in stats.summary(6, top_values=0)


def test_field_stats_only_nulls():
    stats = FieldStats()
    stats.add(None)
    stats.add(None)
    out = stats.summary(records=2, top_values=5)
    assert out == {"types": {"null": 2}, "present": 2, "missing": 0, "nulls": 2,
                   "null_or_missing": 2, "distinct": 0, "duplicates": 0}


# --- Profile ---------------------------------------------------------------------------------


SMALL = [
    {"a": "x", "b": 1},
    {"a": "yy", "b": None},
    {"a": "x"},
    {"b": 1, "a": "x"},  # the first record again, keys in another order
    [1, 2],  # not an object
    "text",  # not an object
]


def test_profile_counts_records_invalid_and_duplicates():
    profile = Profile()
    for record in SMALL:
        profile.add(record)
    assert profile.records == 4
    assert profile.invalid == 2
    assert profile.duplicate_records == 1
    report = profile.report(top_values=5)
    assert report["records"] == 4
    assert report["invalid_records"] == 2
    assert report["duplicate_records"] == 1
    assert list(report["fields"]) == ["a", "b"]

    a = report["fields"]["a"]
    assert a["present"] == 4 and a["missing"] == 0 and a["nulls"] == 0
    assert a["types"] == {"string": 4}
    assert a["distinct"] == 2 and a["duplicates"] == 2
    assert a["length"] == {"min": 1, "max": 2, "mean": 1.25}
    assert a["top"] == [{"value": "x", "count": 3}, {"value": "yy", "count": 1}]

    b = report["fields"]["b"]
    assert b["present"] == 3
    assert b["missing"] == 1
    assert b["nulls"] == 1
    assert b["null_or_missing"] == 2
    assert b["types"] == {"integer": 2, "null": 1}
    assert b["distinct"] == 1 and b["duplicates"] == 1
    assert "length" not in b and "top" not in b


def test_empty_profile():
    report = Profile().report()
    assert report == {"records": 0, "invalid_records": 0, "duplicate_records": 0, "fields": {}}


def test_profile_fields_are_sorted_and_missing_counts_per_field():
    profile = Profile()
    profile.add({"z": 1})
    profile.add({"m": 1})
    profile.add({"a": 1, "z": 2})
    report = profile.report()
    assert list(report["fields"]) == ["a", "m", "z"]
    assert [report["fields"][k]["missing"] for k in ("a", "m", "z")] == [2, 2, 1]


# --- profile_records -------------------------------------------------------------------------


def test_profile_records_reports_progress_every_n():
    records = [{"i": i % 3} for i in range(7)]
    sink = ListSink()
    config = ProfileConfig(progress_every=3, top_values=2)
    report = profile_records(lines(records), config, sink, total=7)

    steps = [step for step, _ in sink.metrics_calls]
    assert steps == [3, 6, 7]
    assert sink.metrics_calls[0][1]["records_seen"] == 3.0
    assert sink.metrics_calls[0][1]["progress"] == pytest.approx(3 / 7)
    assert sink.metrics_calls[1][1]["progress"] == pytest.approx(6 / 7)
    assert all(v["records_per_s"] > 0 for _, v in sink.metrics_calls)
    final = sink.metrics_calls[-1][1]
    assert final["progress"] == 1.0
    assert final["records_seen"] == 7.0
    assert final["duplicate_records"] == 4.0  # 7 records, 3 distinct
    assert sink.asked == 2  # asked whether to stop at each progress point

    assert report["records"] == 7
    assert report["invalid_records"] == 0
    assert report["duplicate_records"] == 4
    assert report["fields"]["i"]["distinct"] == 3
    assert report["elapsed_s"] >= 0


def test_profile_records_without_total_has_no_intermediate_progress():
    sink = ListSink()
    profile_records(lines([{"a": 1}] * 4), ProfileConfig(progress_every=2), sink)
    assert [s for s, _ in sink.metrics_calls] == [2, 4, 4]
    assert "progress" not in sink.metrics_calls[0][1]
    assert sink.metrics_calls[-1][1]["progress"] == 1.0


def test_profile_records_counts_bad_lines_as_invalid():
    raw = [b'{"a": 1}\n', b"not json\n", b"[1, 2]\n", b'{"a": 2}\n', b"\xff\xfe\n"]
    sink = ListSink()
    report = profile_records(raw, ProfileConfig(progress_every=100), sink, total=5)
    assert report["records"] == 2
    assert report["invalid_records"] == 3
    assert sink.metrics_calls == [(5, sink.metrics_calls[0][1])]
    assert sink.metrics_calls[0][1]["records_seen"] == 5.0


def test_profile_records_stops_at_max_records():
    records = [{"i": i} for i in range(10)]
    sink = ListSink()
    config = ProfileConfig(max_records=4, progress_every=2)
    report = profile_records(lines(records), config, sink, total=10)
    assert report["records"] == 4
    assert report["fields"]["i"]["distinct"] == 4
    assert [s for s, _ in sink.metrics_calls] == [2, 4, 4]
    final = sink.metrics_calls[-1][1]
    assert final["progress"] == 1.0 and final["records_seen"] == 4.0


def test_max_records_counts_invalid_lines_too():
    raw = [b"nope\n", b'{"a": 1}\n', b'{"a": 2}\n', b'{"a": 3}\n']
    report = profile_records(raw, ProfileConfig(max_records=2), ListSink())
    assert report["records"] == 1 and report["invalid_records"] == 1


def test_profile_records_stops_when_the_sink_says_so():
    sink = ListSink(stop_after=1)
    with pytest.raises(Stopped, match="after 4 records"):
        profile_records(lines([{"i": i} for i in range(10)]), ProfileConfig(progress_every=2),
                        sink, total=10)
    assert [s for s, _ in sink.metrics_calls] == [2]


def test_profile_config_rejects_unknown_fields_and_bounds():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ProfileConfig.model_validate({"unknown": 1})
    with pytest.raises(ValidationError):
        ProfileConfig.model_validate({"progress_every": 0})
    with pytest.raises(ValidationError):
        ProfileConfig.model_validate({"max_records": 0})
    assert ProfileConfig().model_dump() == {"dataset": None, "max_records": None,
                                            "progress_every": 1000, "top_values": 5}
