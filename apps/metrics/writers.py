"""Set-based insertion of metric points: PostgreSQL COPY, or one multi-row INSERT.

Returns the ids given to the points, so a stream replay can send exactly those points.
On PostgreSQL the ids are reserved from the table's sequence in one statement and sent
with the COPY (COPY cannot return generated ids).
"""

from __future__ import annotations

from django.db import connection

from apps.metrics.models import MetricPoint

Row = tuple[str, int, float, float]  # (name, step, value, wall_time)


def insert_points(run_id: object, rows: list[Row]) -> list[int]:
    """Insert ``rows`` for one run inside the caller's transaction; returns their ids."""
    if connection.vendor == "postgresql":
        return _copy_postgres(run_id, rows)
    created = MetricPoint.objects.bulk_create(
        [MetricPoint(run_id=run_id, name=n, step=s, value=v, wall_time=w) for n, s, v, w in rows],
        batch_size=2000,
    )
    return [p.pk for p in created]


def _copy_postgres(run_id: object, rows: list[Row]) -> list[int]:
    table = MetricPoint._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT nextval(pg_get_serial_sequence(%s, 'id')) FROM generate_series(1, %s)",
            [table, len(rows)],
        )
        ids = [r[0] for r in cursor.fetchall()]
        raw = cursor.cursor  # the psycopg 3 cursor under Django's wrapper
        columns = "(id, run_id, name, step, value, wall_time)"
        # One text-format buffer instead of a write_row() call per point: a third of the
        # cost. Names are the only free text; COPY's escapes cover them.
        run = str(run_id)
        names = {n: n.translate(_COPY_ESCAPES) for n in {r[0] for r in rows}}
        buffer = "".join(
            f"{point_id}\t{run}\t{names[name]}\t{step}\t{value!r}\t{wall!r}\n"
            for point_id, (name, step, value, wall) in zip(ids, rows, strict=True)
        )
        with raw.copy(f"COPY {table} {columns} FROM STDIN") as copy:
            copy.write(buffer.encode())
    return ids


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
