"""On PostgreSQL the rollup table's unique index also carries every column a read takes
(INCLUDE), so a downsampled read is an index-only scan of one contiguous range of the index:
~200 pages for a 1M-point series instead of one heap page per rollup row (rows written at
ingest interleave across series on the heap). The key, the name and the ON CONFLICT target
are unchanged, so the model's UniqueConstraint still describes it. Autovacuum visits the
table more often, since index-only scans skip the heap only on pages it has marked
all-visible. SQLite (embedded, small deployments) keeps its plain index."""

from __future__ import annotations

from django.db import migrations

TABLE = "metrics_metricrollup"
KEY = "(run_id, name, width, bucket)"
COVERED = "INCLUDE (last_step, vmin, vmax, last_value, count, last_wall)"


def forwards(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"ALTER TABLE {TABLE} DROP CONSTRAINT uniq_rollup_bucket, "
        f"ADD CONSTRAINT uniq_rollup_bucket UNIQUE {KEY} {COVERED}")
    schema_editor.execute(f"ALTER TABLE {TABLE} SET (autovacuum_vacuum_scale_factor = 0.02, "
                          f"autovacuum_vacuum_insert_scale_factor = 0.02)")


def backwards(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"ALTER TABLE {TABLE} DROP CONSTRAINT uniq_rollup_bucket, "
        f"ADD CONSTRAINT uniq_rollup_bucket UNIQUE {KEY}")
    schema_editor.execute(f"ALTER TABLE {TABLE} RESET (autovacuum_vacuum_scale_factor, "
                          f"autovacuum_vacuum_insert_scale_factor)")


class Migration(migrations.Migration):

    dependencies = [
        ("metrics", "0005_retention"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
