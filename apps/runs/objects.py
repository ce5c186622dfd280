"""Objects a run writes to the object store, and the one rule for their URIs.

Workers report URIs (checkpoints, reports, QC reports); a worker token may belong to a team
admin, so a reported URI is a claim to check, not a fact. Every run owns one key prefix,
``teams/<team id>/runs/<run id>/``, handed to its worker in the claim. A reported URI is
accepted only when it names an object under that prefix (no ``.``, ``..`` or empty
segments), reported under the run's live lease, and the object is in the store — that is
what "written by that run" means to a server that does not see the writes themselves.
Reads go the same way: the run row decides the prefix, and a stored URI outside it (a row
written before this rule) is refused rather than followed.
"""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from apps.core.exceptions import Conflict, InvalidInput, NotFound
from apps.core.storage import store

MAX_REPORT_BYTES = 32 * 1024 * 1024


def run_prefix(*, team_id: int, run_id: object) -> str:
    """The object key prefix owned by one run (no trailing slash)."""
    return f"teams/{team_id}/runs/{run_id}"


def prefix_of(run: Any) -> str:
    return run_prefix(team_id=run.team_id, run_id=run.pk)


def legacy_prefixes(run: Any) -> tuple[str, ...]:
    """Where workers wrote before prefixes carried the team (``runs/<id>``; profile reports
    ``reports/<id>``): still keyed by this run's own id, so rows written then stay readable.
    New reports are accepted only under :func:`prefix_of`."""
    return (f"runs/{run.pk}", f"reports/{run.pk}")


def _key_under_prefix(run: Any, uri: str, prefixes: tuple[str, ...] | None = None) -> str | None:
    """The key ``uri`` names inside one of the run's prefixes, or None when it names anything
    else (another prefix, the bare prefix, a '.', '..' or empty segment)."""
    for prefix in prefixes or (prefix_of(run),):
        base = f"{store().url}/{prefix}/"
        if not isinstance(uri, str) or not uri.startswith(base):
            continue
        rest = uri[len(base):]
        parts = rest.split("/")
        if not rest or any(p in ("", ".", "..") or "\\" in p for p in parts):
            return None
        return f"{prefix}/{rest}"
    return None


def check_reported(run: Any, uri: str, *, field: str = "uri") -> str:
    """Refuse (400) a URI a worker reports for ``run`` unless it names an existing object under
    the run's own prefix; returns the URI."""
    if _key_under_prefix(run, uri) is None:
        raise InvalidInput(
            f"{field} must name an object under this run's prefix "
            f"{store().url}/{prefix_of(run)}/ (no '.', '..' or empty segments); got "
            f"{str(uri)[:200]!r}.",
            code="uri_outside_run", details={field: [str(uri)[:200]]},
        )
    try:
        present = store().exists(uri)
    except (OSError, ValueError, ClientError):
        present = False
    if not present:
        raise InvalidInput(f"{field}: no object at {uri[:200]}; upload it before reporting it.",
                           code="object_missing", details={field: [uri[:200]]})
    return uri


def owns(run: Any, uri: str) -> bool:
    """Whether a stored URI lies under ``run``'s prefix, or the legacy per-run one (rows
    from before the rule that point anywhere else are not followed)."""
    return _key_under_prefix(run, uri, (prefix_of(run), *legacy_prefixes(run))) is not None


def read_json(run: Any, uri: str, *, what: str = "report") -> dict[str, Any]:
    """A JSON object the run wrote, resolved through the run row: 404 when the run has none
    or it is gone from the store, 409 when the stored URI lies outside the run's prefix or
    the object is not one JSON document."""
    if not uri:
        raise NotFound(f"Run {run.pk} has no {what} (yet).")
    if not owns(run, uri):
        raise Conflict(f"Run {run.pk}'s {what} URI lies outside the run's own objects; it is "
                       "not served.", code="uri_outside_run")
    try:
        handle = store().open_binary(uri)
    except (OSError, ValueError, ClientError) as exc:  # a folder, a missing file, NoSuchKey
        raise NotFound(f"Run {run.pk}'s {what} is missing from the object store.") from exc
    try:
        data = handle.read(MAX_REPORT_BYTES + 1)
    finally:
        handle.close()
    if len(data) > MAX_REPORT_BYTES:
        raise Conflict(f"Run {run.pk}'s {what} is larger than {MAX_REPORT_BYTES} bytes; read "
                       "it from the object store.", code="report_too_large")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONL, binary, or absurdly nested
        raise Conflict(f"Run {run.pk}'s {what} is not a JSON document ({type(exc).__name__}).",
                       code="report_unreadable") from exc
    if not isinstance(value, dict):
        raise Conflict(f"Run {run.pk}'s {what} is a JSON {type(value).__name__}, not an object.",
                       code="report_unreadable")
    return value
