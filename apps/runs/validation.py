"""Turn a launch request into a frozen, validated run document (shared by create and
preview, so a preview that passes is a create that passes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from pydantic import ValidationError

from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.core.storage import store
from apps.datasets.models import DatasetVersion
from apps.datasets.selectors import read_records
from apps.datasets.selectors import resolve_version as resolve_dataset
from apps.environments.models import EnvironmentVersion, QcStatus
from apps.environments.selectors import resolve_version as resolve_environment
from apps.projects.models import Project
from apps.projects.selectors import project_by_slug
from apps.runs.models import Checkpoint, Pool
from apps.runs.selectors import resolve_checkpoint
from apps.runs.specs import KINDS, KindSpec, available_kinds
from apps.teams.models import Team
from workers import egress

MAX_ATTEMPTS_LIMIT = 20
MAX_TAGS = 16
TAG_MAX_LENGTH = 40
TAG_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,40}")


@dataclass
class RunPlan:
    project: Project
    kind: str
    name: str
    config: dict[str, Any]
    pool: str
    priority: int
    datasets: dict[str, DatasetVersion]
    environment: EnvironmentVersion | None
    environments: list[EnvironmentVersion] = field(default_factory=list)
    base_checkpoint: Checkpoint | None = None
    base_model: dict[str, Any] | None = None
    max_attempts: int = 3
    tags: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "project": self.project.slug,
            "kind": self.kind,
            "name": self.name,
            "pool": self.pool,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "tags": self.tags,
            "config": self.config,
            "datasets": {
                alias: {"dataset": v.dataset.slug, "digest": v.digest, "number": v.number,
                        "record_count": v.record_count}
                for alias, v in self.datasets.items()
            },
            "environment": _describe_env(self.environment) if self.environment else None,
            "environments": [_describe_env(v) for v in self.environments],
            "base_model": self.base_model,
        }


def _describe_env(version: EnvironmentVersion) -> dict[str, Any]:
    return {"environment": version.environment.slug, "digest": version.digest,
            "number": version.number, "qc_status": version.qc_status}


def _config_errors(exc: ValidationError) -> tuple[str, dict[str, list[str]]]:
    details: dict[str, list[str]] = {}
    for err in exc.errors():
        path = ".".join(str(p) for p in ("config", *err["loc"]))
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        details.setdefault(path, []).append(message)
    first = next(iter(details.items()))
    return f"{first[0]}: {first[1][0]}", details


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


def _endpoints(kind: str, config: dict[str, Any]) -> list[tuple[str, str]]:
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


def check_egress(config: dict[str, Any], kind: str) -> None:
    """Refuse endpoints and model directories outside the operator's allow-lists
    (CRUCIBLE_ENDPOINT_ALLOW, CRUCIBLE_MODEL_PATH_ROOTS), naming the field and the rule;
    the worker checks again, resolved, before it connects or loads."""
    allow = egress.EndpointAllow.parse(settings.CRUCIBLE["ENDPOINT_ALLOW"])
    for where, url in _endpoints(kind, config):
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


def resolve_base_model(
    *, team: Team, ref: str, config: dict[str, Any]
) -> tuple[dict[str, Any], Checkpoint | None, dict[str, Any]]:
    """Write ``base_model`` into the raw config's ``model`` section.

    ``preset`` (the tiny MoE), ``path:/abs/dir`` or ``/abs/dir`` (a model directory on the
    workers), ``run:<id>`` (that run's latest checkpoint), ``run:<id>@<step>`` or
    ``checkpoint:<id>``. A checkpoint is pinned (its object-store URI goes into the frozen
    config) and brings its own tokenizer. Returns (config, checkpoint, description).
    """
    model = config.get("model", {})
    if not isinstance(model, dict):
        raise InvalidInput("config.model must be an object.", details={"config.model": ["object"]})
    if "source" in model or "path" in model:
        raise InvalidInput(
            "Give the base model once: either base_model or config.model.source/path.",
            details={"base_model": ["also set in config.model"]},
        )
    ref = ref.strip()
    checkpoint = None
    if ref == "preset":
        model = {**model, "source": "preset"}
        described: dict[str, Any] = {"kind": "preset"}
    elif ref.startswith(("path:", "/")):
        path = ref.removeprefix("path:")
        if not path.startswith("/"):
            raise InvalidInput(f"base_model path '{path}' must be absolute (a directory on the "
                               "workers).", details={"base_model": [ref]})
        model = {**model, "source": "path", "path": path}
        described = {"kind": "path", "path": path}
    elif ref.startswith(("run:", "checkpoint:")):
        checkpoint = resolve_checkpoint(team=team, ref=ref)
        model = {**model, "source": "path", "path": checkpoint.uri}
        tokenizer = config.get("tokenizer", {})
        if not isinstance(tokenizer, dict):
            raise InvalidInput("config.tokenizer must be an object.",
                               details={"config.tokenizer": ["object"]})
        # The checkpoint's weights only make sense with the tokenizer saved beside them.
        config = {**config, "tokenizer": {**tokenizer, "source": "model"}}
        described = {"kind": "checkpoint", "checkpoint": checkpoint.pk,
                     "run": str(checkpoint.run_id), "step": checkpoint.step,
                     "uri": checkpoint.uri}
    else:
        raise InvalidInput(
            f"Unknown base_model '{ref[:100]}': use 'preset', 'path:/abs/dir', "
            "'run:<run id>[@<step>]' or 'checkpoint:<id>'.",
            details={"base_model": [ref[:100]]},
        )
    return {**config, "model": model}, checkpoint, described


def plan_run(
    *,
    team: Team,
    project: str,
    kind: str,
    config: dict[str, Any],
    name: str = "",
    pool: str | None = None,
    priority: int = 0,
    datasets: list[str] | None = None,
    environment: str | None = None,
    environments: list[str] | None = None,
    base_model: str | None = None,
    max_attempts: int | None = None,
    tags: list[str] | None = None,
) -> RunPlan:
    if kind not in KINDS:
        raise InvalidInput(
            f"Run kind '{kind}' has no engine in this version of Crucible; available: "
            f"{', '.join(available_kinds())}.",
            details={"kind": [f"unavailable kind '{kind}'"]},
        )
    spec = KINDS[kind]
    limits.check_text(name or "", field="name", limit=limits.NAME)
    if not isinstance(config, dict):
        raise InvalidInput("config must be a JSON object.", details={"config": ["object"]})
    limits.check_json(config, field="config", limit=limits.CONFIG_BYTES)
    base_checkpoint, base_described = None, None
    if base_model:
        if not spec.base_model:
            raise InvalidInput(f"A {kind} run takes no base model.",
                               details={"base_model": [base_model[:100]]})
        config, base_checkpoint, base_described = resolve_base_model(
            team=team, ref=base_model, config=config)
    try:
        parsed = spec.schema.model_validate(config)
    except ValidationError as exc:
        message, details = _config_errors(exc)
        raise InvalidInput(f"Invalid config: {message}", details=details) from exc
    if pool is not None and pool not in Pool.values:
        raise InvalidInput(f"Unknown pool '{pool}'; pools are {', '.join(Pool.values)}.",
                           details={"pool": [pool]})
    attempts = _max_attempts(max_attempts)
    clean_tags = validate_tags(tags)
    project_obj = project_by_slug(team=team, slug=project)

    pinned: dict[str, DatasetVersion] = {}
    for ref in datasets or []:
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
    env_versions = _environments(team, spec, kind, environment, environments)
    if kind == "train":
        _check_train_config(parsed, env_versions)
        _check_training_datasets(parsed, pinned)

    normalized = parsed.model_dump(mode="json")
    check_egress(normalized, kind)
    wanted_alias = normalized.get("dataset")
    if kind == "profile":
        if wanted_alias is None:
            normalized["dataset"] = next(iter(pinned))
        elif wanted_alias not in pinned:
            raise InvalidInput(
                f"config.dataset '{wanted_alias}' is not among the pinned datasets "
                f"({', '.join(pinned)}).",
                details={"config.dataset": ["not pinned"]},
            )
    return RunPlan(
        project=project_obj, kind=kind, name=name, config=normalized,
        pool=pool or spec.default_pool, priority=priority, datasets=pinned,
        environment=env_versions[0] if env_versions else None, environments=env_versions,
        base_checkpoint=base_checkpoint, base_model=base_described, max_attempts=attempts,
        tags=clean_tags,
    )


def _check_train_config(parsed: Any, env_versions: list[EnvironmentVersion]) -> None:
    """Fields of the engine's config that a platform run would carry without using them are
    refused, so the frozen config says only what the run did: the environment comes from the
    pinned versions (QC-gated), the checkpoint folder from the worker (checkpoints live in the
    object store)."""
    if parsed.environment is not None:
        raise InvalidInput(
            "config.environment is for local runs (python -m workers.rl train); on the "
            "platform register it as an environment version, let QC pass it, and pin it with "
            "'environments'.", details={"config.environment": ["not used on the platform"]})
    if parsed.task is not None and env_versions:
        pins = ", ".join(f"{v.environment.slug}@v{v.number}" for v in env_versions)
        raise InvalidInput(
            f"config.task (the built-in arithmetic task) does not apply: this run trains on "
            f"its pinned environment(s) {pins}; remove config.task.",
            details={"config.task": ["the pinned environments replace it"]})
    if parsed.checkpoint.dir is not None:
        raise InvalidInput(
            "config.checkpoint.dir is chosen by the worker on the platform (a scratch folder "
            "per attempt; checkpoints are kept in the object store); remove it.",
            details={"config.checkpoint.dir": ["set by the worker"]})


def _check_training_datasets(parsed: Any, pinned: dict[str, DatasetVersion]) -> None:
    """A train run's pinned datasets are warm-start data (SFT pairs or preference pairs): each
    must have that shape (judged by its first record; the worker checks every record) and its
    phase must be on, so no pinned dataset is silently ignored."""
    from workers.rl.spec import PinnedDataError, check_roles, record_role, shape_hint

    templated = parsed.sft.prompt_template is not None
    roles = {}
    for alias, version in pinned.items():
        label = f"{alias}@v{version.number}"
        first = read_records(version, offset=0, limit=1)
        role = record_role(first[0], templated=templated) if first else None
        if role is None:
            fields = sorted(first[0]) if first and isinstance(first[0], dict) else []
            raise InvalidInput(
                f"Dataset {label} cannot be a training dataset: {shape_hint()}; its first "
                f"record has {', '.join(fields) or 'nothing'}.",
                details={"datasets": [f"{label}: not SFT or preference records"]},
            )
        roles[label] = role
    try:
        check_roles(roles, sft_steps=parsed.sft.steps, sft_environment=parsed.sft.environment,
                    preference_steps=parsed.preference.steps)
    except PinnedDataError as exc:
        raise InvalidInput(f"Invalid config: {exc}", details={"datasets": [str(exc)]}) from exc


def validate_tags(tags: Any) -> list[str]:
    """Tags as given, each once in first-seen order; refused whole (naming the first bad
    one) so a launch never keeps some tags and drops others."""
    if tags is None:
        return []
    if not isinstance(tags, list | tuple):
        raise InvalidInput("tags must be a list of strings.", details={"tags": ["list"]})
    if len(tags) > MAX_TAGS:
        raise InvalidInput(f"tags: at most {MAX_TAGS} tags per run; got {len(tags)}.",
                           details={"tags": [f"{len(tags)} given"]})
    clean: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            shown = repr(tag)[:60]
            raise InvalidInput(
                f"tags: {shown} is not a tag; a tag is 1 to {TAG_MAX_LENGTH} letters, digits, "
                "'-', '_' or '.'.",
                details={"tags": [shown]},
            )
        if tag not in clean:
            clean.append(tag)
    return clean


def _max_attempts(value: int | None) -> int:
    if value is None:
        return int(settings.CRUCIBLE.get("MAX_ATTEMPTS", 3))
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidInput(f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}.",
                           details={"max_attempts": [repr(value)[:50]]})
    return value


def _environments(
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
    check_qc(versions, kind, spec.qc_gate, key)
    return versions
