"""Reads for the capacity planner: the model config a plan starts from (a preset, a pasted
``config.json``, or the ``config.json`` inside one of the team's checkpoints) and the plan
itself, computed by the pure planner in ``workers.capacity``. Nothing here writes."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

from apps.core.exceptions import InvalidInput
from apps.core.storage import store
from apps.runs.models import Checkpoint
from apps.runs.selectors import resolve_checkpoint
from apps.teams.models import Team
from workers.capacity import PRESETS, ConfigError, Request, plan, shape_from_config

#: A config.json is a few kilobytes; anything far bigger is not one.
CONFIG_MAX_BYTES = 256 * 1024
#: How far into a checkpoint tar (read as a stream from S3) to look for its config.json
#: before giving up: DeepSpeed state sorts before ``hf/`` in a periodic checkpoint.
SCAN_LIMIT_BYTES = 4 * 1024**3
CONFIG_NAMES = ("hf/config.json", "config.json")
CHECKPOINT_CHOICES = 50


@dataclass(frozen=True)
class ModelSource:
    config: dict[str, Any]
    label: str  # what the page and the API say the plan is for


def checkpoint_choices(team: Team, limit: int = CHECKPOINT_CHOICES) -> list[tuple[str, str]]:
    """The team's newest kept checkpoints as (``checkpoint:<id>``, label) for a picker."""
    rows = (Checkpoint.objects.select_related("run").filter(team=team, pruned_at__isnull=True)
            .order_by("-created_at", "-pk")[:limit])
    return [(f"checkpoint:{c.pk}", f"{c.run.name or str(c.run_id)[:8]} @ step {c.step}")
            for c in rows]


def _read_config(handle: IO[bytes], where: str) -> dict[str, Any]:
    seekable = bool(getattr(handle, "seekable", lambda: False)())
    scanned = 0
    # A local object is a file: tarfile seeks past each member's data. From S3 it is a
    # stream: members are read through, up to SCAN_LIMIT_BYTES.
    with tarfile.open(fileobj=handle, mode="r:*" if seekable else "r|*") as tar:
        for member in tar:
            if member.isfile() and member.name.lstrip("./") in CONFIG_NAMES:
                if member.size > CONFIG_MAX_BYTES:
                    break
                raw = tar.extractfile(member)
                data = raw.read() if raw is not None else b""
                try:
                    doc = json.loads(data)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise InvalidInput(f"{where}: its config.json is not valid JSON ({exc})."
                                       ) from exc
                if not isinstance(doc, dict):
                    raise InvalidInput(f"{where}: its config.json is not a JSON object.")
                return doc
            scanned += member.size
            if not seekable and scanned > SCAN_LIMIT_BYTES:
                break
    raise InvalidInput(f"{where} has no Hugging Face config.json (looked for "
                       f"{' or '.join(CONFIG_NAMES)}); paste the model's config instead.",
                       details={"checkpoint": ["no config.json"]})


def checkpoint_config(team: Team, ref: str) -> ModelSource:
    """The ``config.json`` saved with a checkpoint of the team (``checkpoint:<id>``,
    ``run:<run id>`` for its latest, ``run:<run id>@<step>``)."""
    try:
        ckpt = resolve_checkpoint(team=team, ref=ref)
    except InvalidInput as exc:  # its words name base_model; here the field is checkpoint
        raise InvalidInput(exc.message.replace("base_model", "checkpoint"),
                           details={"checkpoint": [ref[:120]]}) from exc
    where = f"checkpoint {ckpt.pk} (run {ckpt.run_id}, step {ckpt.step})"
    try:
        with store().open_binary(ckpt.uri) as handle:
            doc = _read_config(handle, where)
    except (OSError, ValueError, tarfile.TarError) as exc:
        if isinstance(exc, InvalidInput):
            raise
        raise InvalidInput(f"{where} cannot be read from the object store as a checkpoint "
                           f"archive ({type(exc).__name__}).",
                           details={"checkpoint": [ref[:120]]}) from exc
    return ModelSource(config=doc, label=f"{ckpt.run.name or ckpt.run_id} @ step {ckpt.step}")


def model_source(team: Team, *, preset: str | None = None,
                 config: Mapping[str, Any] | None = None,
                 checkpoint: str | None = None) -> ModelSource:
    """Exactly one of the three; the serializer has already checked that."""
    if preset:
        return ModelSource(config=dict(PRESETS[preset]), label=preset)
    if checkpoint:
        return checkpoint_config(team, checkpoint)
    return ModelSource(config=dict(config or {}), label=str((config or {}).get(
        "_name_or_path") or (config or {}).get("model_type") or "pasted config")[:120])


def capacity_plan(team: Team, data: Mapping[str, Any]) -> dict[str, Any]:
    """The plan for validated request ``data`` (apps.capacity.serializers), as the API
    returns it, with ``source`` naming the model."""
    source = model_source(team, preset=data.get("preset"), config=data.get("config"),
                          checkpoint=data.get("checkpoint"))
    try:
        shape = shape_from_config(source.config)
    except ConfigError as exc:
        raise InvalidInput(exc.message, details={"config": {exc.field[:100]: [exc.message]}}
                           ) from exc
    request = Request(
        concurrency=data["concurrency"], context=data["context"], gpu=data["gpu"],
        dtype=data["dtype"], kv_dtype=data["kv_dtype"], headroom=data["headroom"],
        prefill_chunk=data["prefill_chunk"], max_gpus=data["max_gpus"])
    return {"source": source.label, **plan(shape, request).as_dict()}
