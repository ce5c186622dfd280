"""Diff of two record streams (the canonical JSONL lines of two dataset versions).

Records are matched by a key field when every record of both sides has that field and no
key repeats within a side: then a record whose key is on both sides with different content
is *changed*. The first usable field of ``keys`` is used (by default ``id``, then ``uid``,
the synthesis engine's content id). With no usable key, records are matched by content
(their canonical line) as multisets, and a diff has only *added* and *removed* records.

Two passes keep memory at a hash per record: the first indexes both sides (key -> content
hash, line number); the second reads back only the records that will be shown (``limit`` per
kind). Pure: takes callables that yield lines, so tests need no object store.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Lines = Callable[[], Iterable[bytes]]
DEFAULT_KEYS = ("id", "uid")

_KEY_MISSING = object()


def _hash(line: bytes) -> bytes:
    return hashlib.blake2b(line.rstrip(b"\n"), digest_size=16).digest()


def _key_value(record: Any, key: str) -> object:
    if not isinstance(record, dict) or key not in record:
        return _KEY_MISSING
    return json.dumps(record[key], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class _KeyCheck:
    """Why a candidate key field cannot pair records on one side (kept to explain it)."""

    missing: int = 0  # records without the field
    first_missing: int | None = None  # its line number
    duplicates: int = 0  # records whose value an earlier record already had
    example: str | None = None  # one repeated value (JSON)

    @property
    def usable(self) -> bool:
        return not self.missing and not self.duplicates


@dataclass
class _Index:
    #: per candidate key field: key value -> (content hash, line no)
    by_key: dict[str, dict[str, tuple[bytes, int]]]
    checks: dict[str, _KeyCheck] = field(default_factory=dict)
    by_content: Counter[bytes] = field(default_factory=Counter)
    first_line: dict[bytes, list[int]] = field(default_factory=dict)  # hash -> line numbers
    count: int = 0


def _index(lines: Iterable[bytes], keys: Sequence[str]) -> _Index:
    index = _Index(by_key={k: {} for k in keys}, checks={k: _KeyCheck() for k in keys})
    for number, line in enumerate(lines):
        digest = _hash(line)
        index.by_content[digest] += 1
        index.first_line.setdefault(digest, []).append(number)
        index.count += 1
        if not keys:
            continue
        record = json.loads(line)
        for key in keys:
            table, check = index.by_key[key], index.checks[key]
            value = _key_value(record, key)
            if value is _KEY_MISSING:
                check.missing += 1
                if check.first_missing is None:
                    check.first_missing = number
            elif value in table:
                check.duplicates += 1
                check.example = check.example or value  # type: ignore[assignment]
            else:
                table[value] = (digest, number)  # type: ignore[index]
    return index


def _why_not(key: str, sides: list[tuple[str, _KeyCheck]]) -> str:
    parts = []
    for label, check in sides:
        if check.duplicates:
            many = check.duplicates != 1
            parts.append(f"{check.duplicates} record{'s' if many else ''} of {label} "
                         f"repeat{'' if many else 's'} an earlier {key} (e.g. {check.example})")
        if check.missing:
            many = check.missing != 1
            parts.append(f"{check.missing} record{'s' if many else ''} of {label} "
                         f"{'have' if many else 'has'} no {key} (the first is record "
                         f"{(check.first_missing or 0) + 1})")
    return "; ".join(parts)


def explain_match(keys: Sequence[str], key: str | None, a: _Index, b: _Index,
                  labels: tuple[str, str]) -> str:
    """A sentence saying how records were paired and, when a key was asked for but could not
    be used, why not — so "matched by content" never silently replaces a key."""
    def why(k: str) -> str:
        return _why_not(k, [(labels[0], a.checks[k]), (labels[1], b.checks[k])])

    if key:
        text = (f"Records were matched by {key}: every record on both sides has one and none "
                f"repeats, so a record whose {key} is on both sides with other content "
                "counts as changed.")
        for k in keys[: list(keys).index(key)]:
            text += f" ({k} was not usable: {why(k)}.)"
        return text
    if not keys:
        return ("Records were matched by content (no key field asked for): a record that "
                "changed shows as one removed and one added.")
    reasons = "; ".join(f"{k}: {why(k)}" for k in keys)
    return (f"Records were matched by content, not by {' or '.join(keys)}, because no key "
            f"field pairs records one to one ({reasons}). A record that changed therefore "
            "shows as one removed and one added; pick a key that is unique on both sides "
            "to see changes.")


def _read(lines: Iterable[bytes], wanted: set[int]) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    if not wanted:
        return found
    last = max(wanted)
    for number, line in enumerate(lines):
        if number in wanted:
            found[number] = json.loads(line)
        if number >= last:
            break
    return found


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Top-level fields whose values differ (added or removed fields included)."""
    return sorted(k for k in before.keys() | after.keys()
                  if before.get(k, _KEY_MISSING) != after.get(k, _KEY_MISSING))


def diff_records(old: Lines, new: Lines, *, keys: Sequence[str] = DEFAULT_KEYS,
                 limit: int = 50, labels: tuple[str, str] = ("the old version",
                                                             "the new version")) -> dict:
    """Records added, removed and changed going from ``old`` to ``new``.

    ``old`` and ``new`` return a fresh iterator of lines on each call (they are read twice).
    ``keys`` are the candidate key fields, in order of preference; empty: match by content.
    """
    a, b = _index(old(), keys), _index(new(), keys)
    key = next((k for k in keys if a.checks[k].usable and b.checks[k].usable), None)
    mode = "key" if key else "content"
    added_lines: list[int] = []
    removed_lines: list[int] = []
    changed_pairs: list[tuple[str, int, int]] = []
    if key:
        old_keys, new_keys = a.by_key[key], b.by_key[key]
        added_lines = sorted(new_keys[k][1] for k in new_keys.keys() - old_keys.keys())
        removed_lines = sorted(old_keys[k][1] for k in old_keys.keys() - new_keys.keys())
        changed_pairs = sorted(
            ((k, old_keys[k][1], new_keys[k][1]) for k in old_keys.keys() & new_keys.keys()
             if old_keys[k][0] != new_keys[k][0]),
            key=lambda pair: pair[2],
        )
        unchanged = len(old_keys.keys() & new_keys.keys()) - len(changed_pairs)
    else:
        added_lines = sorted(_surplus(b, a))
        removed_lines = sorted(_surplus(a, b))
        unchanged = sum((a.by_content & b.by_content).values())
    shown_added, shown_removed = added_lines[:limit], removed_lines[:limit]
    shown_changed = changed_pairs[:limit]
    new_rows = _read(new(), set(shown_added) | {p[2] for p in shown_changed})
    old_rows = _read(old(), set(shown_removed) | {p[1] for p in shown_changed})
    changed = []
    for value, old_no, new_no in shown_changed:
        before, after = old_rows[old_no], new_rows[new_no]
        changed.append({"key": json.loads(value), "before": before, "after": after,
                        "fields": changed_fields(before, after)})
    return {
        "mode": mode,
        "key": key,
        "match": explain_match(keys, key, a, b, labels),
        "counts": {"old": a.count, "new": b.count, "added": len(added_lines),
                   "removed": len(removed_lines), "changed": len(changed_pairs),
                   "unchanged": unchanged},
        "added": [new_rows[n] for n in shown_added],
        "removed": [old_rows[n] for n in shown_removed],
        "changed": changed,
        "limit": limit,
        "truncated": max(len(added_lines), len(removed_lines), len(changed_pairs)) > limit,
    }


def _surplus(side: _Index, other: _Index) -> Iterator[int]:
    """Line numbers of ``side`` records beyond the copies ``other`` also has."""
    for digest, count in side.by_content.items():
        extra = count - other.by_content.get(digest, 0)
        if extra > 0:
            yield from side.first_line[digest][-extra:]
