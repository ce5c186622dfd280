from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.core.actor import Actor
from apps.teams.models import Team
from apps.teams.services import worker_token_create


class Command(BaseCommand):
    help = "Create a worker token (for every team, or --team SLUG) and print it once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--name", default="pool")
        parser.add_argument("--team", default=None)

    def handle(self, *args: object, **opts: str) -> None:
        team = None
        if opts["team"]:
            team = Team.objects.filter(slug=opts["team"]).first()
            if team is None:
                raise CommandError(f"No team '{opts['team']}'.")
        _, raw = worker_token_create(actor=Actor.system(), team=team, name=opts["name"])
        self.stdout.write(raw)
