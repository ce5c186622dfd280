"""Tool calling in the Hermes / Qwen chat format: tools offered in the system prompt, calls
parsed out of the completion text. It sits with the environments because both the policy
server (workers.inference) and the RL engine's terminal episodes (workers.rl.episodes) read it.

The format (what Qwen2.5/Qwen3 and Hermes models are trained on, and what vLLM's `hermes`
parser reads):

- the tools are listed in the system prompt, one JSON object per line inside
  `<tools></tools>`, with how to call them;
- the model calls a tool by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  (several blocks for parallel calls), before or after any plain text;
- a tool's result goes back as `<tool_response>\\n...\\n</tool_response>`.

Parsing a finished completion (`parse_completion`) and streaming one (`ToolCallStream`) give
the same answer: every well-formed block becomes a call (`arguments` re-serialised as a JSON
string, as OpenAI sends it; ids `call_<hex>`), whitespace next to a call block is dropped, and
the rest is the content (None when only calls remain). A block whose JSON is malformed, or
that names no function, is left in the content as written: a bad generation is shown, never
a crash or a guessed call. A final block cut off before its `</tool_call>` counts if what it
holds is already a complete call. The stream never shows a partial `<tool_call>` tag as
content: text that may still open a block is held until it cannot.

`tool_choice` (see `forced_prefix`): "none" offers no tools and parses no calls; "auto" offers
them; "required" starts the assistant turn with `<tool_call>\\n` and a named choice with
`<tool_call>\\n{"name": "<name>", "arguments": ` so the model can only continue a call (the
prefix is part of the prompt and of the parsed text). If the model then fails to finish a
well-formed call, what it produced comes back as content with the finish reason it sampled;
no call is invented for it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

TOOLS_INTRO = (
    "# Tools\n\n"
    "You can call functions to help with the request. Their signatures are listed inside "
    "<tools></tools>, one JSON object per line:\n<tools>\n"
)
TOOLS_OUTRO = (
    "\n</tools>\n\n"
    "To call a function, write one block per call: a JSON object with the function's name "
    "and its arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tools_prompt(functions: Sequence[dict[str, Any]]) -> str:
    """The system-prompt block that offers `functions` (OpenAI `tools` entries, each
    `{"type": "function", "function": {...}}`)."""
    lines = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return TOOLS_INTRO + lines + TOOLS_OUTRO


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it; `arguments` a JSON text or an object."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as the model reads it."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def text_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                  tool_role: str = "tool") -> list[tuple[str, str]]:
    """A conversation with tools as plain (role, text) messages in this format, for chat
    formats that only know text: the tools block ends the first system message (or is one),
    an assistant's calls follow its text as `<tool_call>` blocks, a tool's result is a
    `tool_role` message wrapped in `<tool_response>` (consecutive results share one message
    when `tool_role` is not "tool", as Qwen's template does with "user").

    `messages` are OpenAI-shaped dicts with text `content`; a call's `arguments` may be a
    JSON text or an object."""
    out: list[tuple[str, str]] = []
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"])
                      for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + blocks)
        elif role == "tool":
            text = response_text(text)
            if tool_role != "tool" and out and out[-1][0] == tool_role and \
                    out[-1][1].startswith(RESPONSE_OPEN):
                out[-1] = (tool_role, out[-1][1] + "\n" + text)
                continue
            role = tool_role
        out.append((role, text))
    if tools:
        block = tools_prompt(tools)
        if out and out[0][0] in ("system", "developer"):
            first = out[0][1]
            out[0] = (out[0][0], f"{first}\n\n{block}" if first else block)
        else:
            out.insert(0, ("system", block))
    return out


def forced_prefix(tool_choice: str | None, offered: bool) -> str:
    """Text the assistant turn starts with so the model must write a call ("" for "none",
    "auto" or when no tools are offered). `tool_choice` is "required", a function's name,
    or one of "none" / "auto" / None."""
    if not offered or tool_choice in (None, "none", "auto"):
        return ""
    if tool_choice == "required":
        return OPEN + "\n"
    return OPEN + "\n" + json.dumps({"name": tool_choice}, ensure_ascii=False)[:-1] + \
        ', "arguments": '


def parse_call(block: str) -> ToolCall | None:
    """The call inside one block's text (between the tags), or None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_completion(text: str, max_calls: int | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """A finished completion as (content, calls); see the module docstring for the rules.
    `max_calls` (1 for `parallel_tool_calls: false`): later blocks stay in the content."""
    stream = ToolCallStream(max_calls)
    stream.push(text)
    stream.finish()
    return stream.content(), stream.calls


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed message: content text, or a call's start (index, id, name)
    or its arguments."""

    content: str | None = None
    call: ToolCall | None = None
    index: int = 0
    arguments: bool = False  # this delta carries `call.arguments`, not its header

    def as_openai(self) -> dict[str, Any]:
        """The `delta` of a chat.completion.chunk."""
        if self.call is None:
            return {"content": self.content}
        if self.arguments:
            return {"tool_calls": [{"index": self.index,
                                    "function": {"arguments": self.call.arguments}}]}
        return {"tool_calls": [{"index": self.index, "id": self.call.id, "type": "function",
                                "function": {"name": self.call.name, "arguments": ""}}]}


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that begins the `<tool_call>` tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0


class ToolCallStream:
    """Turns text deltas into content and tool-call deltas as they become certain.

    States: outside a block, text is content except for a tail that may begin `<tool_call>`
    and trailing whitespace (dropped if a call follows); inside a block, text waits for
    `</tool_call>`, then the block is a call (a header delta, then an arguments delta) or,
    malformed, content as written."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._pieces: list[str] = []  # content sent so far
        self._buf = ""  # unsent text: outside a block, or the open block's text after OPEN
        self._space = ""  # whitespace held before what comes next
        self._in_block = False
        self._after_call = False  # whitespace right after a call is dropped

    def content(self) -> str | None:
        text = "".join(self._pieces)
        return None if self.calls and not text else text

    def push(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                block, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self._in_block = False
                out += self._close(block, closed=True)
                continue
            start = self._buf.find(OPEN)
            if start >= 0 and not self._full():
                out += self._text(self._buf[:start])
                self._buf = self._buf[start + len(OPEN):]
                self._in_block = True
                continue
            if self._full():
                out += self._text(self._buf)
                self._buf = ""
                return out
            keep = _partial_open(self._buf)
            out += self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[Delta]:
        """The end of the completion: an open block that already holds a whole call counts;
        anything else held is content."""
        out: list[Delta] = []
        if self._in_block:
            block, self._buf, self._in_block = self._buf, "", False
            out += self._close(block, closed=False)
        if self._buf:
            out += self._text(self._buf)
            self._buf = ""
        if self._space:
            out += self._emit(self._space)
            self._space = ""
        return out

    # ---- helpers ---------------------------------------------------------------------------

    def _full(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _text(self, text: str) -> list[Delta]:
        """Content outside blocks; its trailing whitespace is held until what follows is
        known (a call drops it)."""
        if self._after_call:
            stripped = text.lstrip()
            if not stripped:
                return []
            text, self._after_call = stripped, False
        if not text:
            return []
        body = text.rstrip()
        held = text[len(body):]
        out = self._emit(self._space + body) if body else []
        self._space = held if body else self._space + held
        return out

    def _close(self, block: str, *, closed: bool) -> list[Delta]:
        call = parse_call(block.strip())
        if call is None:
            raw = OPEN + block + (CLOSE if closed else "")
            out = self._emit(self._space + raw)
            self._space, self._after_call = "", False
            return out
        self._space, self._after_call = "", True
        index = len(self.calls)
        self.calls.append(call)
        return [Delta(call=call, index=index), Delta(call=call, index=index, arguments=True)]

    def _emit(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._pieces.append(text)
        return [Delta(content=text)]
