"""A version's (or batch's) manifest arranged for a page: the headline facts, stage
statistics as a table, rejection reasons, distinct-n, and the raw JSON.

Manifests come from the synthesis engine; this reads the fields it is expected to carry
under a few plausible names and never fails on a shape it does not know (the raw JSON is
always shown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

STAGE_KEYS = ("stages", "stage_stats", "stage_statistics", "statistics")
REJECTION_KEYS = ("rejections", "rejection_reasons", "rejected_reasons", "rejection_examples")
DISTINCT_KEYS = ("distinct_n", "diversity")
CONFIG_KEYS = ("generator", "config", "generator_config")


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class ManifestView:
    facts: list[tuple[str, Any]] = field(default_factory=list)
    stages: Table | None = None
    rejections: Table | None = None
    distinct_n: list[tuple[str, Any]] = field(default_factory=list)
    raw: str = "{}"

    @property
    def empty(self) -> bool:
        return self.raw == "{}"


def _first(manifest: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((manifest[k] for k in keys if k in manifest), None)


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value


def table(value: Any) -> Table | None:
    """A dict of dicts, a list of dicts, or a flat dict of scalars as rows and columns."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        headers = sorted({k for v in value.values() for k in v})
        return Table(["", *headers],
                     [[name, *(_cell(v.get(h, "")) for h in headers)] for name, v in value.items()])
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        headers = list(dict.fromkeys(k for v in value for k in v))
        return Table(headers, [[_cell(v.get(h, "")) for h in headers] for v in value])
    if isinstance(value, dict) and value:
        return Table(["", "value"], [[k, _cell(v)] for k, v in value.items()])
    return None


def present(manifest: dict[str, Any] | None) -> ManifestView:
    manifest = manifest or {}
    view = ManifestView(raw=json.dumps(manifest, indent=2, sort_keys=True, default=str))
    config = _first(manifest, CONFIG_KEYS)
    if isinstance(config, dict) and config.get("name"):
        view.facts.append(("generator", config["name"]))
    elif isinstance(config, str):
        view.facts.append(("generator", config))
    for name in ("seed", "candidates", "accepted", "engine"):
        if name in manifest:
            view.facts.append((name, manifest[name]))
    parents = manifest.get("parents")
    if isinstance(parents, list) and parents:
        labels = [f"{p.get('dataset', '?')} v{p.get('number', '?')}" if isinstance(p, dict)
                  else str(p)[:12] for p in parents]
        view.facts.append(("parents", ", ".join(labels)))
    review = manifest.get("review")
    if isinstance(review, dict):
        view.facts.append(("review", f"{review.get('rejected', '?')} of "
                                     f"{review.get('reviewed', '?')} sampled records rejected"
                                     f" (target {review.get('target_error_rate', '?')}, "
                                     f"confidence {review.get('confidence', '?')})"))
    view.stages = table(_first(manifest, STAGE_KEYS))
    view.rejections = table(_first(manifest, REJECTION_KEYS))
    distinct = _first(manifest, DISTINCT_KEYS)
    if isinstance(distinct, dict):
        view.distinct_n = [(str(k), _cell(v)) for k, v in distinct.items()]
    return view
