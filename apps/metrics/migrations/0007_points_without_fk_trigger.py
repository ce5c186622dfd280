"""Points and rollups keep their ``run`` relation in Django but lose the database's foreign
key: its check ran as a trigger for every inserted row, about a fifth of a 1000-point batch's
ingest statement. See ``MetricPoint.run`` for why nothing can point at a missing run."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


def run_without_fk() -> models.ForeignKey:
    return models.ForeignKey(db_constraint=False, db_index=False,
                             on_delete=django.db.models.deletion.CASCADE, related_name="+",
                             to="runs.run")


class Migration(migrations.Migration):
    dependencies = [
        ("metrics", "0006_rollup_covering_index"),
        ("runs", "0008_attempt_start_drained"),
    ]

    operations = [
        migrations.AlterField(model_name=model, name="run", field=run_without_fk())
        for model in ("metricpoint", "metricrollup")
    ]
