"""Canonical form, hashing and schema inference of dataset records.

A record is a JSON object; its canonical line is ``json.dumps(sort_keys=True,
separators=(",", ":"), ensure_ascii=False)``. The version digest is the SHA-256 of the
canonical lines joined by newlines, so the same records in the same order always give the
same id, however they were formatted on upload.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import math
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


PARQUET_MAGIC = b"PAR1"


def parse_upload(stream: IO[bytes]) -> Iterator[Any]:
    """The records of an uploaded file: Parquet (by its magic bytes) or JSON lines."""
    head = stream.read(len(PARQUET_MAGIC))
    stream.seek(0)
    return parse_parquet(stream) if head == PARQUET_MAGIC else parse_jsonl(stream)


def _json_value(value: Any, row: int, column: str) -> Any:
    """A Parquet cell as JSON: timestamps, dates and times as ISO 8601 text, decimals as
    their exact text, durations as seconds; NaN, infinities and binary refused (JSON cannot
    hold them, and guessing would change the data)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(
                f"Row {row}, column {column!r} holds {value}, which JSON cannot represent; "
                "store missing values as null.", details={"file": [f"row {row}: {column}"]})
        return value
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_value(v, row, f"{column}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v, row, column) for v in value]
    if isinstance(value, bytes | bytearray):
        raise InvalidInput(f"Row {row}, column {column!r} is binary; dataset records are JSON: "
                           "decode it to text or leave the column out.",
                           details={"file": [f"row {row}: {column}"]})
    raise InvalidInput(f"Row {row}, column {column!r} has a {type(value).__name__} value that "
                       "JSON cannot hold.", details={"file": [f"row {row}: {column}"]})


def parse_parquet(stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet file as JSON objects, read a record batch at a time (pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(stream)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"The file starts like Parquet but cannot be read: {exc}",
                           details={"file": ["unreadable Parquet"]}) from exc
    row = 0
    batches = parquet.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise InvalidInput(f"Parquet file unreadable after row {row}: {exc}",
                               details={"file": [f"row {row}"]}) from exc
        for record in batch.to_pylist():
            row += 1
            yield {str(k): _json_value(v, row, str(k)) for k, v in record.items()}


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


def write_canonical(records: Iterable[Any], *, folder: Path, max_records: int,
                    max_bytes: int | None = None) -> CanonicalFile:
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
                if max_bytes is not None and size + len(line) > max_bytes:
                    raise PayloadTooLarge(
                        f"The records of this upload exceed {max_bytes} bytes as JSON lines; "
                        "split it into parts and derive versions from each other."
                    )
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
