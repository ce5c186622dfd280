from __future__ import annotations

from django.core.management.base import BaseCommand

from apps.metrics.models import MetricPoint
from apps.metrics.rollups import rebuild


class Command(BaseCommand):
    help = ("Recompute metric series and rollups from stored points (for points loaded "
            "around the ingest API, e.g. bulk imports). All runs, or --run ID.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--run", default=None)

    def handle(self, *args: object, **opts: str) -> None:
        runs = [opts["run"]] if opts["run"] else list(
            MetricPoint.objects.values_list("run_id", flat=True).distinct())
        for run_id in runs:
            rebuild(MetricPoint._meta.get_field("run").target_field.to_python(run_id))
            self.stdout.write(f"rebuilt {run_id}")
