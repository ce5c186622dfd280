"""Dataset and environment references resolved to the versions a run pins, each once, in
the numbers its kind takes, environments through the kind's QC gate."""

from __future__ import annotations

from typing import Any

from apps.core.exceptions import InvalidInput
from apps.datasets.models import DatasetVersion
from apps.datasets.selectors import resolve_version as resolve_dataset
from apps.environments.models import EnvironmentVersion, QcStatus
from apps.environments.selectors import resolve_version as resolve_environment
from apps.runs.specs import KindSpec
from apps.teams.models import Team
from workers.envs.spec import TERMINAL_RUN_KINDS


def _qc_reason(report: dict[str, Any]) -> str:
    """A one-line reason from a QC report, whatever engine wrote it."""
    if isinstance(report, dict):
        reasons = report.get("block_reasons")  # workers/qc's report (crucible.qc/1)
        if isinstance(reasons, list) and reasons:
            return "; ".join(str(r) for r in reasons)[:300]
        for key in ("reason", "message", "error"):
            value = report.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()[:300]
    return "see the version's qc_report"


def check_qc(versions: list[EnvironmentVersion], kind: str, gate: str, key: str) -> None:
    """Refuse environment versions a run of ``kind`` may not use, naming each and why."""
    if gate == "any":
        return
    refused = []
    for v in versions:
        ref = f"{v.environment.slug}@v{v.number}"
        if v.qc_status == QcStatus.FAILED:
            refused.append(f"{ref} failed QC: {_qc_reason(v.qc_report)}")
        elif gate == "passed" and v.qc_status != QcStatus.PASSED:
            refused.append(f"{ref} has not passed QC (status {v.qc_status}); run QC on it "
                           "first")
    if refused:
        raise InvalidInput(
            f"A {kind} run needs environment versions that "
            f"{'passed' if gate == 'passed' else 'did not fail'} QC: {'; '.join(refused)}.",
            code="qc_not_passed", details={key: refused},
        )


def pin_datasets(team: Team, spec: KindSpec, kind: str,
                 refs: list[str] | None) -> dict[str, DatasetVersion]:
    """Each reference resolved to a version, keyed by its dataset's slug (the alias the
    worker reads it by)."""
    pinned: dict[str, DatasetVersion] = {}
    for ref in refs or []:
        version = resolve_dataset(team=team, ref=ref)
        alias = version.dataset.slug
        if alias in pinned:
            raise InvalidInput(f"Dataset '{alias}' is pinned twice.",
                               details={"datasets": [ref]})
        pinned[alias] = version
    low, high = spec.datasets
    if len(pinned) < low or (high is not None and len(pinned) > high):
        wanted = f"exactly {low}" if low == high else f"between {low} and {high}"
        raise InvalidInput(
            f"A {kind} run pins {wanted} dataset version(s); got {len(pinned)}.",
            details={"datasets": [f"{len(pinned)} given"]},
        )
    return pinned


def pin_environments(
    team: Team, spec: KindSpec, kind: str, environment: str | None,
    environments: list[str] | None,
) -> list[EnvironmentVersion]:
    """``environment`` (one reference) and ``environments`` (several) resolve to versions,
    each once, checked against the kind's QC gate."""
    key = "environments" if environments else "environment"
    refs = ([environment] if environment else []) + list(environments or [])
    versions: list[EnvironmentVersion] = []
    for ref in refs:
        version = resolve_environment(team=team, ref=ref)
        if any(v.pk == version.pk for v in versions):
            raise InvalidInput(f"Environment version '{ref}' is pinned twice.",
                               details={key: [ref]})
        versions.append(version)
    low, high = spec.environments
    if len(versions) < low or (high is not None and len(versions) > high):
        wanted = f"exactly {low}" if low == high else (
            f"at least {low}" if high is None else f"between {low} and {high}")
        raise InvalidInput(
            f"A {kind} run pins {wanted} environment version(s); got {len(versions)}.",
            details={key: [f"{len(versions)} given"]},
        )
    for version in versions:
        env = (version.spec or {}).get("env") if isinstance(version.spec, dict) else None
        if isinstance(env, dict) and env.get("source") == "terminal" \
                and kind not in TERMINAL_RUN_KINDS:
            raise InvalidInput(
                f"Environment version '{version.environment.slug}@v{version.number}' holds "
                f"terminal tasks, which only {', '.join(sorted(TERMINAL_RUN_KINDS))} runs take "
                f"so far; a {kind} run cannot play them yet (docs/agents.md).",
                details={key: [f"{version.environment.slug}@v{version.number}"]})
        if isinstance(env, dict) and env.get("source") == "terminal" and len(versions) > 1:
            raise InvalidInput(
                f"Environment version '{version.environment.slug}@v{version.number}' holds "
                "terminal tasks, which train alone: pin it as the run's only environment "
                "(one run per terminal environment).",
                details={key: [f"{version.environment.slug}@v{version.number}"]})
    check_qc(versions, kind, spec.qc_gate, key)
    return versions
