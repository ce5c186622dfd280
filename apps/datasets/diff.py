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
class _Index:
    #: per candidate key field: key value -> (content hash, line no); None once unusable
    by_key: dict[str, dict[str, tuple[bytes, int]] | None]
    by_content: Counter[bytes] = field(default_factory=Counter)
    first_line: dict[bytes, list[int]] = field(default_factory=dict)  # hash -> line numbers
    count: int = 0


def _index(lines: Iterable[bytes], keys: Sequence[str]) -> _Index:
    index = _Index(by_key={k: {} for k in keys})
    for number, line in enumerate(lines):
        digest = _hash(line)
        index.by_content[digest] += 1
        index.first_line.setdefault(digest, []).append(number)
        index.count += 1
        live = [k for k, table in index.by_key.items() if table is not None]
        if not live:
            continue
        record = json.loads(line)
        for key in live:
            table = index.by_key[key]
            assert table is not None
            value = _key_value(record, key)
            if value is _KEY_MISSING or value in table:
                index.by_key[key] = None  # not a usable key on this side
            else:
                table[value] = (digest, number)  # type: ignore[index]
    return index


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
                 limit: int = 50) -> dict:
    """Records added, removed and changed going from ``old`` to ``new``.

    ``old`` and ``new`` return a fresh iterator of lines on each call (they are read twice).
    ``keys`` are the candidate key fields, in order of preference; empty: match by content.
    """
    a, b = _index(old(), keys), _index(new(), keys)
    key = next((k for k in keys if a.by_key[k] is not None and b.by_key[k] is not None), None)
    mode = "key" if key else "content"
    added_lines: list[int] = []
    removed_lines: list[int] = []
    changed_pairs: list[tuple[str, int, int]] = []
    if key:
        old_keys, new_keys = a.by_key[key], b.by_key[key]
        assert old_keys is not None and new_keys is not None
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
