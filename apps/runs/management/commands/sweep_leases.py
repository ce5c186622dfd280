from __future__ import annotations

from django.core.management.base import BaseCommand

from apps.core.actor import Actor
from apps.runs.services import sweep_expired
from apps.scheduling.services import sweep_lost_nodes


class Command(BaseCommand):
    help = ("Requeue runs whose worker lease expired and mark silent nodes lost (the pools' "
            "beat does this every 30 s).")

    def handle(self, *args: object, **opts: object) -> None:
        for run in sweep_expired(actor=Actor.system()):
            self.stdout.write(f"requeued {run.pk}")
        for name in sweep_lost_nodes():
            self.stdout.write(f"node {name} lost")
