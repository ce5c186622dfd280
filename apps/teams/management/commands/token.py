"""``manage.py token create|list|revoke``: personal API tokens from the command line, so a
script gets its first token without scraping the login form (the secret is printed once;
only its SHA-256 is stored, as for tokens made in the web UI or the API)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.teams.models import ApiToken, TokenKind
from apps.teams.services import personal_token_create, token_revoke


class Command(BaseCommand):
    help = ("Personal API tokens: 'create --user NAME' prints a new token once; 'list --user "
            "NAME' shows a user's tokens; 'revoke PREFIX' revokes one.")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token and print its secret once")
        create.add_argument("--user", required=True, help="username the token acts as")
        create.add_argument("--name", default="script", help="label shown in the token list")
        create.add_argument("--expires-days", type=int, default=None,
                            help="expire after this many days (default: never)")
        listing = sub.add_parser("list", help="a user's tokens (prefixes, never secrets)")
        listing.add_argument("--user", required=True)
        revoke = sub.add_parser("revoke", help="revoke a token by its prefix")
        revoke.add_argument("prefix", help="the 12 hex digits after crc_ (see 'list')")

    def handle(self, *args: Any, **opts: Any) -> None:
        action = opts["action"]
        if action == "create":
            self._create(opts)
        elif action == "list":
            self._list(opts)
        else:
            self._revoke(opts)

    @staticmethod
    def _user(username: str) -> Any:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"No user '{username}'. Create one with "
                               "'python manage.py createsuperuser' (or through the admin).")
        if not user.is_active:
            raise CommandError(f"User '{username}' is inactive; its tokens would not work.")
        return user

    def _create(self, opts: dict[str, Any]) -> None:
        user = self._user(opts["user"])
        days = opts["expires_days"]
        if days is not None and days < 1:
            raise CommandError("--expires-days must be at least 1.")
        if not 1 <= len(opts["name"]) <= 100:
            raise CommandError("--name must be 1 to 100 characters.")
        expires = timezone.now() + timedelta(days=days) if days else None
        try:
            _, raw = personal_token_create(actor=Actor.system(), user=user, name=opts["name"],
                                           expires_at=expires)
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(raw)

    def _list(self, opts: dict[str, Any]) -> None:
        user = self._user(opts["user"])
        rows = ApiToken.objects.filter(kind=TokenKind.PERSONAL, user=user).order_by("created_at")
        for token in rows:
            state = "revoked" if token.revoked_at else (
                f"expires {token.expires_at:%Y-%m-%d}" if token.expires_at else "active")
            self.stdout.write(f"crc_{token.prefix}_…  {token.name}  {state}  "
                              f"created {token.created_at:%Y-%m-%d %H:%M}")

    def _revoke(self, opts: dict[str, Any]) -> None:
        prefix = str(opts["prefix"]).removeprefix("crc_").split("_")[0]
        token = ApiToken.objects.filter(kind=TokenKind.PERSONAL, prefix=prefix).first()
        if token is None:
            raise CommandError(f"No personal token with prefix '{prefix}'.")
        token_revoke(actor=Actor.system(), token=token)
        self.stdout.write(f"revoked crc_{prefix}_…")
