"""How a checkpoint's policy saw its prompts, recorded next to its weights.

The RL engine trains on prompts as plain text (`3+4=`, or an environment's opening messages
rendered by `workers.envs.adapter`), never through a tokenizer's chat template. A chat client
that talks to such a checkpoint must get the same text, or a model that answers 27/40 sums from
its raw prompt answers 0/40 through `role: content` lines. So every model folder the engine
writes (the SFT / preference warm starts, periodic checkpoints, the final export) carries
`prompt_format.json`:

    {"format": "raw", "layout": "single_turn"}     # or "episode" for multi-turn / tool use

and whoever serves it (`python -m workers.inference serve`, eval runs, the verifiers path)
renders chat messages that way unless told otherwise. `format = "chat_template"` would say the
tokenizer's own template was used (a folder without the file, e.g. a downloaded model, is
served with its template if it has one).

Layouts, the same functions the engine renders with:
- `single_turn`: the messages' contents joined by a blank line (a lone user message verbatim);
- `episode`: every non-assistant message as its content and a blank line (a tool result tagged
  with the tool's name), every earlier assistant turn as its text, the eos token and a blank
  line; the model continues from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from workers.envs.adapter import SEPARATOR, message_text, render_plain

FILE = "prompt_format.json"
Layout = Literal["single_turn", "episode"]


class PromptFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    format: Literal["raw", "chat_template"] = "raw"
    layout: Layout = "single_turn"


class PromptFormatError(ValueError):
    """A conversation the recorded format cannot express, or an unreadable record."""


def write(folder: Path, fmt: PromptFormat) -> None:
    path = Path(folder) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text(json.dumps(fmt.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read(folder: str | Path) -> PromptFormat | None:
    """The recorded format, or None for a folder the engine did not write."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        return PromptFormat.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as exc:
        raise PromptFormatError(f"{path} is not a prompt-format record: {exc}") from None


def render(messages: list[tuple[str, str]], layout: Layout, eos_token: str) -> str:
    """Chat messages as the prompt text the engine trained on (see the module docstring)."""
    if messages and messages[-1][0] == "assistant":
        raise PromptFormatError("a raw-prompt model cannot continue an assistant message; end "
                                "the conversation with a user (or tool) message")
    msgs = [{"role": role, "content": content} for role, content in messages]
    if layout == "single_turn":
        return render_plain(msgs)
    out = []
    for m in msgs:
        if m["role"] == "assistant":
            out.append(m["content"] + eos_token + SEPARATOR)
        else:
            out.append(message_text(m))
    return "".join(out)
