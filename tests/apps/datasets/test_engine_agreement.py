"""The synthesis engine replicates the dataset app's canonical record form (engines may not
import apps): these tests, moved here from tests/workers/synthesis so the engine tests load no
Django, keep the two in step."""

from __future__ import annotations

from pathlib import Path

from apps.datasets.records import canonical_line as app_canonical_line
from apps.datasets.records import write_canonical
from tests.workers.synthesis.test_pipeline import MATH
from workers.synthesis import parse_config, synthesize
from workers.synthesis.records import canonical_line, record_uid, records_digest


def test_canonical_lines_match_the_dataset_app() -> None:
    record = {"b": [1, "é"], "a": {"z": None, "y": 1.5}}
    assert canonical_line(record) == app_canonical_line(record)
    assert records_digest([record]) == records_digest([dict(reversed(record.items()))])
    assert record_uid(record) == record_uid({**record, "uid": "x", "verification": []})


def test_a_synthesized_batch_digest_is_the_id_the_dataset_app_gives_it(tmp_path: Path) -> None:
    batch = synthesize(parse_config(MATH))
    stored = write_canonical(batch.records, folder=tmp_path, max_records=1000)
    assert stored.digest == batch.digest
