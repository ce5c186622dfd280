"""Canonical form, hashing and schema inference of dataset records.

A record is a JSON object; its canonical line is ``json.dumps(sort_keys=True,
separators=(",", ":"), ensure_ascii=False)``. The version digest is the SHA-256 of the
canonical lines joined by newlines, so the same records in the same order always give the
same id, however they were formatted on upload.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from apps.core import jsonsafe
from apps.core.exceptions import InvalidInput, PayloadTooLarge


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


def canonical_line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class CanonicalFile:
    path: Path
    digest: str
    record_count: int
    size_bytes: int
    schema: dict[str, list[str]] = field(default_factory=dict)


def parse_jsonl(stream: IO[bytes]) -> Iterator[Any]:
    for number, raw in enumerate(stream, start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            yield jsonsafe.loads(line)
        except jsonsafe.InvalidJSON as exc:
            raise InvalidInput(
                f"Line {number} is not valid JSON: {exc}", details={"file": [f"line {number}"]}
            ) from exc


def write_canonical(records: Iterable[Any], *, folder: Path, max_records: int) -> CanonicalFile:
    """Stream records into a canonical JSONL temp file, hashing and typing as we go."""
    hasher = hashlib.sha256()
    types: dict[str, set[str]] = {}
    count = size = 0
    # Closed by the ``with handle`` below; opened first so the path is known for cleanup.
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115
        dir=folder, prefix="upload-", suffix=".jsonl", delete=False
    )
    path = Path(handle.name)
    try:
        with handle:
            for index, record in enumerate(records):
                if not isinstance(record, dict):
                    raise InvalidInput(
                        f"Record {index} is a JSON {json_type(record)}; every record must be "
                        "a JSON object.",
                        details={"records": [f"record {index} is not an object"]},
                    )
                if count >= max_records:
                    raise PayloadTooLarge(
                        f"More than {max_records} records in one upload; split it into parts "
                        "and derive versions from each other."
                    )
                line = canonical_line(record) + b"\n"
                hasher.update(line)
                handle.write(line)
                size += len(line)
                count += 1
                for key, value in record.items():
                    types.setdefault(key, set()).add(json_type(value))
        if count == 0:
            raise InvalidInput("A dataset version needs at least one record.",
                               details={"records": ["empty"]})
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    schema = {key: sorted(found) for key, found in sorted(types.items())}
    return CanonicalFile(path, hasher.hexdigest(), count, size, schema)
