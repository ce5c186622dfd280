"""Per-field statistics of a stream of JSON records: pure functions, no I/O.

Exact counts for record totals, types, nulls and lengths. Distinct and duplicate
counts hash each value (SHA-1 of its canonical JSON) into a set, so memory grows with
the number of distinct values, about 60 bytes each: fine to millions of records.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _fingerprint(value: Any) -> bytes:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha1(canonical.encode()).digest()


@dataclass
class FieldStats:
    present: int = 0
    nulls: int = 0
    types: Counter[str] = field(default_factory=Counter)
    length_min: int | None = None
    length_max: int | None = None
    length_total: int = 0
    length_count: int = 0
    distinct: set[bytes] = field(default_factory=set)
    top: Counter[str] = field(default_factory=Counter)

    def add(self, value: Any) -> None:
        self.present += 1
        kind = json_type(value)
        self.types[kind] += 1
        if value is None:
            self.nulls += 1
            return
        if isinstance(value, str | list | dict):
            n = len(value)
            self.length_min = n if self.length_min is None else min(self.length_min, n)
            self.length_max = n if self.length_max is None else max(self.length_max, n)
            self.length_total += n
            self.length_count += 1
        self.distinct.add(_fingerprint(value))
        if isinstance(value, str) and len(value) <= 200:
            self.top[value] += 1

    def summary(self, records: int, top_values: int) -> dict[str, Any]:
        missing = records - self.present
        out: dict[str, Any] = {
            "types": dict(sorted(self.types.items())),
            "present": self.present,
            "missing": missing,
            "nulls": self.nulls,
            "null_or_missing": self.nulls + missing,
            "distinct": len(self.distinct),
            "duplicates": self.present - self.nulls - len(self.distinct),
        }
        if self.length_count:
            out["length"] = {
                "min": self.length_min,
                "max": self.length_max,
                "mean": round(self.length_total / self.length_count, 3),
            }
        if top_values and self.top:
            out["top"] = [{"value": v, "count": c} for v, c in self.top.most_common(top_values)]
        return out


@dataclass
class Profile:
    records: int = 0
    invalid: int = 0
    fields: dict[str, FieldStats] = field(default_factory=dict)
    record_fingerprints: set[bytes] = field(default_factory=set)

    def add(self, record: Any) -> None:
        if not isinstance(record, dict):
            self.invalid += 1
            return
        self.records += 1
        self.record_fingerprints.add(_fingerprint(record))
        for key, value in record.items():
            self.fields.setdefault(key, FieldStats()).add(value)

    @property
    def duplicate_records(self) -> int:
        return self.records - len(self.record_fingerprints)

    def report(self, top_values: int = 5) -> dict[str, Any]:
        return {
            "records": self.records,
            "invalid_records": self.invalid,
            "duplicate_records": self.duplicate_records,
            "fields": {name: stats.summary(self.records, top_values)
                       for name, stats in sorted(self.fields.items())},
        }
