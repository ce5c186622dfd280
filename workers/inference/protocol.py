"""The OpenAI request bodies this server accepts, and its error shape.

Fields follow the OpenAI API names so the official client, `verifiers` and other
OpenAI-compatible callers work unchanged, plus the vLLM extensions RL clients send (token-id
prompts, `return_token_ids`, `return_tokens_as_token_ids`, `top_k`, `min_p`,
`repetition_penalty`), and tool calling (`tools`, `tool_choice`, assistant `tool_calls`,
`tool` messages; the format is `workers.envs.toolcalls`). A field the server cannot honour
(presence/frequency penalties...) is refused with a 400 that names it, instead of
being silently ignored; purely informational fields (`user`, `metadata`, ...) are accepted
and ignored, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

MAX_N = 128
MAX_STOPS = 4
T = TypeVar("T", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}  # union-member parts of a loc


class ApiError(Exception):
    """An error the client can act on, rendered as OpenAI's `{"error": {...}}` body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Req):
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class CalledFunction(_Req):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: str  # a JSON text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            obj = json.loads(v)
        except ValueError as exc:
            raise ValueError(f"arguments must be a JSON object encoded as a string: {exc}"
                             ) from None
        if not isinstance(obj, dict):
            raise ValueError("arguments must be a JSON object encoded as a string")
        return v


class ToolCallIn(_Req):
    """A call an earlier assistant turn made (conversation history)."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDef(_Req):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        import jsonschema  # only requests with tools pay for it

        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "the top level"
            raise ValueError(f"not a valid JSON Schema ({exc.message}, at {where})") from None
        if v.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be a JSON Schema of type "
                             f"'object', got type {v.get('type')!r}")
        return v


class ToolDef(_Req):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    refusal: str | None = None  # the official client echoes it back in history

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Req):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # sent by newer clients; nothing to obfuscate


class _Sampling(_Req):
    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, for RL clients (TRL's vLLM client, verifiers): the response carries
    # prompt and completion token ids; logprob tokens are named `token_id:<id>`.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's sampling controls, applied as vLLM orders them: repetition penalty, temperature,
    # top-k, top-p, min-p. -1 / 0 (top_k), 0 (min_p) and 1 (repetition_penalty) are off.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    # Accepted at their neutral values only (anything else would change the output in a way
    # this server cannot honour).
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI treats an explicit null like an omitted field.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _neutral_extensions(self) -> _Sampling:
        neutral = {"skip_special_tokens": (True,), "include_stop_str_in_output": (False,),
                   "ignore_eos": (False,)}
        for name, ok in neutral.items():
            value = getattr(self, name)
            if value is not None and value not in ok:
                raise ValueError(f"{name}={value!r} is not supported by this server "
                                 f"(accepted: {', '.join(map(repr, ok))} or omit it)")
        return self

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(v)}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported by this server; send 0 or omit it")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (as strings), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"a logit_bias value must be between -100 and 100, got "
                                 f"{value} for token {key}")
        return v

    def biases(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()
                            if b))

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {kind!r} is not supported; send 'text', "
                             "'json_object' or 'json_schema'")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError("response_format 'json_schema' needs json_schema: {'name': "
                                 "..., 'schema': {...}}")
            if not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format json_schema.schema must be a JSON object "
                                 "(a JSON schema)")
        return v

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the response must follow (json_object: any object); None for
        free text."""
        kind = (self.response_format or {}).get("type")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            schema: dict[str, Any] = self.response_format["json_schema"].get("schema", {})  # type: ignore[index]
            return schema
        return None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chosen_tool(self) -> str | None:
        """tool_choice as one string: "none", "auto", "required" or a function's name; None
        when no tools are sent (OpenAI's default is then "none", with tools "auto")."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if self.tool_choice is None:
            return "auto" if self.tools else None
        return self.tool_choice

    def check_tools(self) -> None:
        """What a field alone cannot say: tool names unique, tool_choice naming a sent tool,
        tool calls only on assistant turns, every tool message answering an earlier call."""
        names = [t.function.name for t in self.tools or []]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ApiError(f"tools hold two functions named '{name}'; names must be "
                               "unique", param=f"tools.{i}.function.name")
        choice = self.chosen_tool()
        if choice not in (None, "none", "auto", "required") and choice not in names:
            sent = ", ".join(repr(n) for n in names) or "none"
            raise ApiError(f"tool_choice names the function '{choice}', which is not in "
                           f"tools (sent: {sent})", param="tool_choice.function.name")
        if choice == "required" and not names:
            raise ApiError("tool_choice 'required' needs tools", param="tool_choice")
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise ApiError(f"only assistant messages carry tool_calls (message {i} is "
                               f"'{m.role}')", param=f"messages.{i}.tool_calls")
            for call in m.tool_calls or []:
                calls.add(call.id)
            if m.role == "tool":
                if not m.tool_call_id:
                    raise ApiError(f"message {i} has role 'tool' but no tool_call_id; give "
                                   "the id of the call it answers",
                                   param=f"messages.{i}.tool_call_id")
                if m.tool_call_id not in calls:
                    raise ApiError(f"message {i} answers tool call '{m.tool_call_id}', which "
                                   "no earlier assistant message made (its tool_calls ids: "
                                   f"{', '.join(sorted(calls)) or 'none'})",
                                   param=f"messages.{i}.tool_call_id")


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    """`prompt`: text, a list of texts, token ids, or a list of token-id lists (what TRL's vLLM
    client sends), at most 1024 prompts."""

    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1024)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=1024)])
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            return v
        kinds = {type(p) for p in v}
        if kinds in ({str}, {int}, {list}):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of token-id lists, not a mix")

    def prompts(self) -> list[str | Sequence[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)  # type: ignore[arg-type]


def parse_request(cls: type[T], body: Any) -> T:
    """Validate a JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        errors = err.errors()
        # A union reports one error per member; the interesting one is not a type mismatch.
        same = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
        e = next((x for x in same if not x["type"].endswith("_type")), same[0])
        loc = [p for p in e["loc"]
               if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
        param = ".".join(str(p) for p in loc) or None
        if e["type"] == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif e["type"] == "missing":
            msg = f"Missing required parameter: {param}"
        elif param is None:
            msg = e["msg"].removeprefix("Value error, ")
        else:
            msg = f"Invalid value for {param}: {e['msg'].removeprefix('Value error, ')}"
        raise ApiError(msg, param=param,
                       code="missing_required_parameter" if e["type"] == "missing" else
                       "invalid_value") from None
