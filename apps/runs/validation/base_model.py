"""``base_model``: the one launch field that rewrites the config (its ``model`` section and,
for a checkpoint, the tokenizer saved beside it)."""

from __future__ import annotations

from typing import Any

from apps.core.exceptions import InvalidInput
from apps.runs.models import Checkpoint
from apps.runs.selectors import resolve_checkpoint
from apps.teams.models import Team


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


def pin_serving_draft(*, team: Team, config: dict[str, Any]
                      ) -> tuple[dict[str, Any], Checkpoint | None]:
    """An eval run's ``serving.draft`` (a draft checkpoint for speculative decoding), given as
    ``checkpoint:<id>`` or ``run:<id>[@<step>]`` of this team, pinned to its object-store URI
    like the base model. Anything else (a URI, a path) is refused: a team draws drafts only
    from its own checkpoints."""
    serving = config.get("serving")
    if not isinstance(serving, dict) or serving.get("draft") is None:
        return config, None
    ref = serving["draft"]
    if not isinstance(ref, str) or not ref.startswith(("checkpoint:", "run:")):
        raise InvalidInput("config.serving.draft: give a checkpoint of this team as "
                           "'checkpoint:<id>' or 'run:<id>[@<step>]'.",
                           details={"config.serving.draft": [str(ref)[:100]]})
    try:
        checkpoint = resolve_checkpoint(team=team, ref=ref)
    except InvalidInput as exc:
        message = exc.message.replace("base_model", "config.serving.draft", 1)
        raise InvalidInput(message, details={"config.serving.draft": [ref[:100]]}) from exc
    return {**config, "serving": {**serving, "draft": checkpoint.uri}}, checkpoint
