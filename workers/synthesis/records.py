"""Canonical record lines, digests and per-item seeds.

The canonical line replicates `apps.datasets.records.canonical_line` (engines may not import
`apps`): `json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)`, and a batch's
digest is the SHA-256 of those lines each followed by a newline, so a batch's digest is the id the
dataset version will get when its records are stored. A test pins the two together.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any


def canonical_line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def records_digest(records: Iterable[dict[str, Any]]) -> str:
    hasher = hashlib.sha256()
    for record in records:
        hasher.update(canonical_line(record) + b"\n")
    return hasher.hexdigest()


def to_jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(canonical_line(r) + b"\n" for r in records)


def record_uid(record: dict[str, Any]) -> str:
    """A short content id of a record (without its own uid or verification trail)."""
    body = {k: v for k, v in record.items() if k not in ("uid", "verification")}
    return hashlib.sha256(canonical_line(body)).hexdigest()[:16]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the run seed and an item's coordinates; stable across processes and
    Python versions (unlike `hash()`)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1
