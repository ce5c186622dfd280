"""Writes: set a team's policy (admins; audited), screen what a surface is about to store
or send, and log what was found."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.core import audit
from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.filtering import selectors
from apps.filtering.models import FilterPolicy, Finding, Surface
from apps.teams.models import Team
from workers.filtering import Mode, screen_value


class OutputBlocked(DomainError):
    """The team's policy blocks text with secrets or personal data on this surface."""

    status_code = 422
    code = "output_blocked"


@transaction.atomic
def set_policy(*, actor: Actor, team: Team, **modes: str) -> FilterPolicy:
    """Set some surfaces' modes (``samples=``, ``serve=``, ``export=``); the others stay."""
    row, _ = FilterPolicy.objects.select_for_update().get_or_create(team=team)
    before = {s.value: getattr(row, s.value) for s in Surface}
    for surface, value in modes.items():
        setattr(row, Surface(surface).value, Mode(value).value)
    row.updated_by = actor.user
    row.updated_at = timezone.now()
    row.save()
    after = {s.value: getattr(row, s.value) for s in Surface}
    audit.record(actor=actor, action="filtering.policy", team_id=team.pk,
                 target_type="team", target_id=team.slug,
                 data={"before": before, "after": after})
    return row


@dataclass
class ScreenedRows:
    """Rows after a surface's policy: ``rows`` to store (redacted under ``redact``),
    ``hits`` the kinds found per row index."""

    mode: Mode
    rows: list[dict[str, Any]]
    hits: dict[int, list[str]] = field(default_factory=dict)


def screen_rows(*, team_id: int, surface: Surface, rows: list[dict[str, Any]],
                fields: tuple[str, ...], target: tuple[str, Any] = ("batch", "")
                ) -> ScreenedRows:
    """Screen ``fields`` of each row under the team's mode for ``surface``. Under
    ``block`` a row with findings refuses the whole batch (422 ``output_blocked``, its
    ``details`` naming each refused row and the kinds, never the text), so nothing is half
    written; the refusal is logged first, as a finding on ``target`` (type, id)."""
    mode = selectors.mode(team_id, surface)
    if mode == Mode.OFF:
        return ScreenedRows(mode, rows)
    out, hits = [], {}
    for i, row in enumerate(rows):
        screened = screen_value({f: row[f] for f in fields}, mode)
        if screened.kinds:
            hits[i] = list(screened.kinds)
        out.append({**row, **screened.value} if screened.changed else row)
    if mode == Mode.BLOCK and hits:
        kinds = sorted({k for ks in hits.values() for k in ks})
        log(team_id=team_id, surface=surface, action=Mode.BLOCK, target_type=target[0],
            target_id=target[1], kinds=kinds, count=len(hits))
        raise OutputBlocked(
            f"{len(hits)} of {len(rows)} rows contain {', '.join(kinds)}; this team's "
            f"{surface.value} filter blocks them. Leave those rows out and send the rest.",
            details={"blocked": [{"index": i, "kinds": ks} for i, ks in hits.items()]})
    return ScreenedRows(mode, out, hits)


def log(*, team_id: int, surface: Surface, action: Mode, target_type: str, target_id: Any,
        kinds: list[str], count: int = 1) -> Finding:
    with transaction.atomic():
        return Finding.objects.create(team_id=team_id, surface=surface.value,
                                      action=action.value, target_type=target_type,
                                      target_id=str(target_id), kinds=kinds, count=count)


def log_many(*, team_id: int, surface: Surface, action: Mode, target_type: str,
             hits: dict[Any, list[str]]) -> None:
    """One finding per object (e.g. each stored sample with findings), in one INSERT."""
    Finding.objects.bulk_create(
        Finding(team_id=team_id, surface=surface.value, action=action.value,
                target_type=target_type, target_id=str(target_id), kinds=kinds)
        for target_id, kinds in hits.items())


def screen_jsonl(*, team_id: int, surface: Surface, lines: Callable[[], Iterable[bytes]],
                 target: tuple[str, Any]) -> ScreenedRows:
    """Scan every record of a JSONL object (a dataset version being exported) under the
    team's mode: ``hits`` by record index (``rows`` stays empty; the caller streams the
    records, redacting those in ``hits`` under ``redact``). Flag and redact log one finding
    on ``target``; block logs it and refuses (422) before a byte is sent."""
    mode = selectors.mode(team_id, surface)
    if mode == Mode.OFF:
        return ScreenedRows(mode, [])
    hits: dict[int, list[str]] = {}
    for i, line in enumerate(lines()):
        kinds = screen_value(json.loads(line), Mode.FLAG).kinds
        if kinds:
            hits[i] = list(kinds)
    if hits:
        kinds_all = sorted({k for ks in hits.values() for k in ks})
        log(team_id=team_id, surface=surface, action=mode, target_type=target[0],
            target_id=target[1], kinds=kinds_all, count=len(hits))
        if mode == Mode.BLOCK:
            first = sorted(hits)[:20]
            raise OutputBlocked(
                f"{len(hits)} records contain {', '.join(kinds_all)}; this team's export "
                "filter blocks the export. An admin can set it to redact, or fix the records "
                "in a new version.",
                details={"records": len(hits), "kinds": kinds_all,
                         "blocked": [{"index": i, "kinds": hits[i]} for i in first]})
    return ScreenedRows(mode, [], hits)
