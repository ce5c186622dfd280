"""Endpoints and model directories a run's config names, checked against the operator's
allow-lists at launch so a refused run is never queued (the worker checks again)."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from apps.core.exceptions import InvalidInput
from apps.core.storage import store
from workers import egress


def _endpoints(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, base_url) of every endpoint a run's config makes its worker call."""
    found = []
    policy = config.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("base_url"), str):
        found.append(("config.policy.base_url", policy["base_url"]))
    synthesis = config.get("synthesis")
    generators = synthesis.get("generators") if isinstance(synthesis, dict) else None
    for i, gen in enumerate(generators or []):
        endpoint = gen.get("endpoint") if isinstance(gen, dict) else None
        if isinstance(endpoint, dict) and isinstance(endpoint.get("base_url"), str):
            found.append((f"config.synthesis.generators[{i}].endpoint.base_url",
                          endpoint["base_url"]))
    return found


def check_egress(config: dict[str, Any]) -> None:
    """Refuse endpoints and model directories outside the operator's allow-lists
    (CRUCIBLE_ENDPOINT_ALLOW, CRUCIBLE_MODEL_PATH_ROOTS), naming the field and the rule;
    the worker checks again, resolved, before it connects or loads."""
    allow = egress.EndpointAllow.parse(settings.CRUCIBLE["ENDPOINT_ALLOW"])
    for where, url in _endpoints(config):
        try:
            allow.check(url, resolve=False)
        except egress.EgressRefused as exc:
            raise InvalidInput(f"{where}: {exc}", code="not_allowed",
                               details={where: [str(exc)]}) from exc
    model = config.get("model")
    if isinstance(model, dict) and model.get("source") == "path":
        path = str(model.get("path") or "")
        if path.startswith(store().url + "/"):
            return  # a pinned checkpoint object, checked against its run's prefix
        try:
            egress.check_model_path(path, egress.parse_roots(
                settings.CRUCIBLE["MODEL_PATH_ROOTS"]))
        except egress.EgressRefused as exc:
            raise InvalidInput(f"base_model: {exc}", code="not_allowed",
                               details={"base_model": [str(exc)]}) from exc
