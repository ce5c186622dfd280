"""Metric points, sized for millions per run.

Points are inserted in batches (one INSERT per batch); ``MetricBatch`` makes a retried
batch a no-op. The (run, name, step) index serves both the per-series read and the
in-database downsampling.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class MetricPoint(models.Model):
    id = models.BigAutoField(primary_key=True)
    # No database-level foreign key (``db_constraint=False``): its check was a trigger run
    # for every inserted point, ~20% of a 1000-point batch's statement (bench_ingest). Every
    # point is written by the ingest statement, which inserts only after its UPDATE of the
    # run's row returned that row, holding a lock a DELETE of the run must wait for; run
    # deletion cascades through Django's collector, not the database, either way.
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+",
                            db_index=False, db_constraint=False)
    name = models.CharField(max_length=200)
    step = models.BigIntegerField()
    value = models.FloatField()
    wall_time = models.FloatField()

    class Meta:
        indexes = [models.Index(fields=["run", "name", "step"], name="metric_run_name_step")]

    def __str__(self) -> str:
        return f"{self.name}@{self.step}={self.value}"


class MetricBatch(models.Model):
    """One ingested batch. ``seq`` is the writer's batch number (idempotency);
    ``stream_seq`` is its place in the run's live stream, shared with events; the point ids
    ``first_id..last_id`` let a reconnecting client be sent exactly the points it missed."""

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+")
    seq = models.PositiveBigIntegerField()
    stream_seq = models.PositiveBigIntegerField(default=0)
    first_id = models.BigIntegerField(default=0)
    last_id = models.BigIntegerField(default=0)
    point_count = models.PositiveIntegerField()
    received_at = models.DateTimeField(default=timezone.now)
    # When retention dropped this batch's raw points (its rollups remain).
    pruned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="uniq_metric_batch")]
        indexes = [models.Index(fields=["run", "stream_seq"], name="metric_batch_stream")]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq}"


class MetricSeries(models.Model):
    """One (run, name) series: its size and step range, kept current at ingest, so reads
    never scan a million points to learn them."""

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=200)
    count = models.BigIntegerField(default=0)
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    # Set once retention has dropped some of its raw points: reads then come from rollups
    # wherever a rollup width can serve them.
    pruned = models.BooleanField(default=False, db_default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="uniq_series")]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.name}"


class MetricRollup(models.Model):
    """Pre-aggregated buckets of ``width`` steps (min, max, last value and its wall time,
    count), written at ingest for a few widths, so a downsampled read of a huge series merges
    thousands of rollup rows in the database instead of sorting millions of points. Kept
    when retention drops the raw points: reads at rollup resolution never need them."""

    # No database-level foreign key, for the reason given on ``MetricPoint.run``.
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+",
                            db_index=False, db_constraint=False)
    name = models.CharField(max_length=200)
    width = models.IntegerField()
    bucket = models.BigIntegerField()
    vmin = models.FloatField()
    vmax = models.FloatField()
    last_step = models.BigIntegerField()
    last_value = models.FloatField()
    last_wall = models.FloatField(default=0.0)
    count = models.BigIntegerField()

    class Meta:
        # On PostgreSQL migration 0006 makes this index cover the other columns (INCLUDE),
        # so reads are index-only scans; Django cannot say INCLUDE for PostgreSQL alone
        # (it would drop the constraint on SQLite, where ingest's ON CONFLICT needs it).
        constraints = [
            models.UniqueConstraint(fields=["run", "name", "width", "bucket"],
                                    name="uniq_rollup_bucket")
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.name}/{self.width}#{self.bucket}"
