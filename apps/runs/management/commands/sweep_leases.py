from __future__ import annotations

from django.core.management.base import BaseCommand

from apps.core.actor import Actor
from apps.runs.services import sweep_expired


class Command(BaseCommand):
    help = "Requeue runs whose worker lease expired (the pools' beat does this every 30 s)."

    def handle(self, *args: object, **opts: object) -> None:
        for run in sweep_expired(actor=Actor.system()):
            self.stdout.write(f"requeued {run.pk}")
