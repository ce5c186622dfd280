"""The run's live-stream sequence: one counter per run (``Run.event_seq``) that events and
metric batches both take positions from, so a client replays them in one order and can tell
a gap from the end."""

from __future__ import annotations

from django.db import connection, models


def allocate_stream_seq(run: models.Model, count: int) -> int:
    """Reserve ``count`` consecutive positions in the run's live stream; returns the first.
    The caller holds the run's row lock (the runs app's ``leased`` or its own lock)."""
    table = type(run)._meta.db_table
    run_id = run.pk.hex if connection.vendor == "sqlite" else run.pk
    with connection.cursor() as cursor:  # one round trip instead of UPDATE then SELECT
        cursor.execute(f"UPDATE {table} SET event_seq = event_seq + %s WHERE id = %s "
                       "RETURNING event_seq", [count, run_id])
        return cursor.fetchone()[0] - count + 1
