"""OpenAI-compatible HTTP routes (Starlette) over the policy's scheduler (`make_batcher`: the
continuous one for the models the RL engine trains), and ways to run them.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /health`. Streaming (`stream: true`) is answered in the SSE
chunk format OpenAI clients parse, a chunk per token as the batch samples it (the choices of
`n > 1` interleaved), each choice's finish, then usage (`stream_options.include_usage`).

The end-of-sequence token is a stop signal, not text: it is not in a choice's text or
`logprobs`, nor counted in `completion_tokens`. RL clients (TRL's vLLM client, verifiers) get
the token-level view they ask for: `return_token_ids` adds the sampled ids (the final eos
included, as vLLM returns them), and `return_tokens_as_token_ids` names logprob tokens
`token_id:<id>` and shows every sampled id's logprob, eos included, aligned with `token_ids`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers import threads
from workers.envs.toolcalls import (
    Delta,
    ToolCall,
    ToolCallStream,
    forced_prefix,
    parse_completion,
)
from workers.filtering import Mode, screen_text
from workers.inference.engine import (
    EngineOptions,
    Policy,
    Sample,
    SamplingParams,
    TokenEvent,
    make_batcher,
)
from workers.inference.grammar import Grammar, GrammarError, JsonGrammars
from workers.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from workers.rl.rollout import Prompt, cut_at_stop

DEFAULT_CHAT_MAX_TOKENS = 256  # when a chat request names no limit (also capped by context)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_rows: int = 64  # sequences per generation batch
    # The output filter (workers.filtering) on every choice's text: flag adds a `filter`
    # field, redact replaces findings with [REDACTED:<kind>], block empties the choice and
    # ends it with finish_reason "content_filter" (OpenAI's own reason for that). Under
    # redact and block a stream is sent once each choice is complete, and a choice with a
    # finding loses its logprobs and token ids (they would spell the secret out).
    output_filter: Mode = Mode.OFF
    engine: EngineOptions = EngineOptions()


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class OpenAIApp:
    """The Starlette app and the request handling it needs (validation, limits, rendering)."""

    def __init__(self, policy: Policy, config: ServerConfig) -> None:
        self.policy, self.config = policy, config
        self.batcher = make_batcher(policy, config.max_rows, config.engine)
        self._grammars: JsonGrammars | None = None
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._crash},
        )

    def close(self) -> None:
        self.batcher.close()

    # ---- plumbing --------------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = (f"Unknown route {request.method} {request.url.path}" if exc.status_code == 404
               else f"{exc.detail}: {request.method} {request.url.path}")
        return _error(ApiError(msg, status=exc.status_code, type=kind))

    async def _crash(self, request: Request, exc: Exception) -> Response:
        return _error(ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                               type="server_error"))

    def _auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given, key):
            raise ApiError("Incorrect API key provided", status=401, type="authentication_error",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        self._auth(request)
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON: {exc}") from None

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise ApiError(f"The model '{name}' does not exist; this server serves "
                           f"'{self.config.model_name}'", status=404, param="model",
                           code="model_not_found")

    def _params(self, req: ChatCompletionRequest | CompletionRequest, prompts: list[Prompt],
                limit: int | None, top: int) -> tuple[SamplingParams, list[int]]:
        grammar = self._grammar(req) if isinstance(req, ChatCompletionRequest) else None
        lengths = [self.policy.count_tokens(p) for p in prompts]
        ctx = self.policy.context
        if limit is None:
            room = (ctx - max(lengths)) if ctx else DEFAULT_CHAT_MAX_TOKENS
            limit = min(DEFAULT_CHAT_MAX_TOKENS, room)
            if limit < 1:
                raise ApiError(f"the prompt ({max(lengths)} tokens) fills the model's context "
                               f"of {ctx} tokens", param="messages",
                               code="context_length_exceeded")
        if ctx and max(lengths) + limit > ctx:
            raise ApiError(f"This model's maximum context length is {ctx} tokens; the prompt "
                           f"has {max(lengths)} and {limit} were requested for the completion. "
                           "Shorten the prompt or lower max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        bias = req.biases()
        vocab = self.policy.vocab_size
        bad = next((t for t, _ in bias if t >= vocab), None)
        if bad is not None:
            raise ApiError(f"logit_bias names token id {bad}, outside this model's vocabulary "
                           f"of {vocab} ids", param="logit_bias")
        temperature = 1.0 if req.temperature is None else req.temperature
        params = SamplingParams(temperature=temperature,
                                top_p=1.0 if req.top_p is None else req.top_p,
                                max_tokens=limit, stop=tuple(req.stops()), top_logprobs=top,
                                top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0,
                                repetition_penalty=(1.0 if req.repetition_penalty is None
                                                    else req.repetition_penalty),
                                logit_bias=bias, constraint=grammar)
        return params, lengths

    def _grammar(self, req: ChatCompletionRequest) -> Grammar | None:
        """The compiled grammar of the request's response_format (None for free text); the
        llguidance tokenizer is built on the first structured request."""
        schema = req.json_schema()
        if schema is None:
            return None
        if req.chosen_tool() not in (None, "none"):
            raise ApiError("response_format json_object / json_schema cannot be combined with "
                           "tools: the reply is either a tool call or JSON content. Send "
                           "tool_choice 'none' or drop one of them", param="response_format")
        if self._grammars is None:
            self._grammars = JsonGrammars(self.policy.tok, self.policy.tok.eos_token_id)
        try:
            return self._grammars.compile(schema)
        except GrammarError as exc:
            raise ApiError(f"response_format.json_schema.schema is not a usable JSON schema: "
                           f"{exc}", param="response_format") from None

    def _check_n(self, n: int) -> None:
        """The continuous scheduler runs a prompt's n samples side by side: they must fit."""
        limit = getattr(self.batcher, "max_n", None)
        if limit is not None and n > limit:
            raise ApiError(f"n={n} exceeds this server's batch of {limit} sequences "
                           "(serve --max-batch)", param="n")

    def _check_token_ids(self, prompts: list[Prompt]) -> None:
        vocab = self.policy.vocab_size
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                continue
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(f"prompt {i} holds token id {bad}, outside this model's "
                               f"vocabulary of {vocab} ids", param="prompt")

    async def _run(self, prompts: list[Prompt], n: int, params: SamplingParams,
                   seed: int | None) -> list[list[Sample]]:
        fut = self._submit(prompts, n, params, seed)
        return await asyncio.wrap_future(fut)

    def _submit(self, prompts: list[Prompt], n: int, params: SamplingParams, seed: int | None,
                on_token: Callable[[TokenEvent], None] | None = None) -> Future:
        try:
            return self.batcher.submit(prompts, n, params, seed, on_token=on_token)
        except ValueError as exc:  # more rows than the batch holds
            raise ApiError(str(exc), param="n") from None

    def _start_stream(self, prompts: list[Prompt], n: int, params: SamplingParams,
                      seed: int | None) -> asyncio.Queue[tuple[str, Any]]:
        """Submit a job whose tokens arrive on the returned queue as ("token", TokenEvent),
        then ("done", future) once it finished (or failed)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(item: tuple[str, Any]) -> None:
            # From the batcher's thread; a client that went away (its loop closed) must not
            # stop the batch the other requests share.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

        fut = self._submit(prompts, n, params, seed, on_token=lambda ev: put(("token", ev)))
        fut.add_done_callback(lambda f: put(("done", f)))
        return queue

    @staticmethod
    def _usage(lengths: list[int], results: list[list[Sample]]) -> dict[str, int]:
        prompt = sum(lengths)
        completion = sum(s.text_tokens for samples in results for s in samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _token_name(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.policy.token_text(token_id)

    def _shown(self, s: Sample, as_ids: bool) -> int:
        """How many of a sample's tokens its logprobs show: the eos is a stop signal, not text
        (shown only in the token-id view RL clients ask for, aligned with `token_ids`)."""
        return len(s.token_ids) if as_ids else s.text_tokens

    # ---- routes ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        stats: dict[str, Any] = getattr(self.batcher, "stats", dict)()  # e.g. acceptance
        weights = {"weights": "int8" if self.policy.int8 else "float"}
        return JSONResponse({"status": "ok", "model": self.config.model_name,
                             "threads": threads.in_use()["torch_threads"], **weights, **stats})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self.created,
                "owned_by": "crucible", "root": str(self.policy.path),
                "max_model_len": self.policy.context}

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as err:
            return _error(err)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._auth(request)
            self._check_model(request.path_params["model_id"])
        except ApiError as err:
            return _error(err)
        return JSONResponse(self._model_card())

    async def chat(self, request: Request) -> Response:
        try:
            req = parse_request(ChatCompletionRequest, await self._body(request))
            self._check_model(req.model)
            req.check_tools()
            calls = ToolPlan.of(req)
            try:
                if calls.renders:
                    prompt = self.policy.render_tool_chat(calls.messages, calls.offered)
                else:
                    prompt = self.policy.render_chat([(m.role, m.text()) for m in req.messages])
            except ValueError as exc:
                raise ApiError(str(exc), param="messages") from None
            prompt += calls.prefix
            top = (req.top_logprobs or 0) if req.logprobs else 0
            if req.top_logprobs and not req.logprobs:
                raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
            params, lengths = self._params(req, [prompt], req.limit(), top)
            self._check_n(req.n)
            if req.stream and not self._holds_streams:
                return self._stream(self._chat_stream(req, prompt, params, lengths, calls))
            results = await self._run([prompt], req.n, params, req.seed)
        except ApiError as err:
            return _error(err)
        body = self._chat_body(req, prompt, results, lengths, calls)
        if req.stream:
            return self._stream(self._chat_chunks(req, body))
        return JSONResponse(body, headers=self._filter_header)

    def _chat_body(self, req: ChatCompletionRequest, prompt: str, results: list[list[Sample]],
                   lengths: list[int], calls: ToolPlan) -> dict[str, Any]:
        as_ids = req.return_tokens_as_token_ids
        choices = []
        for i, s in enumerate(results[0]):
            shown = self._shown(s, as_ids)
            message, finish = calls.message(s.text, s.finish_reason)
            choice: dict[str, Any] = {
                "index": i, "message": message,
                "logprobs": ({"content": [self._chat_entry(t, lp, alts, as_ids) for t, lp, alts
                                          in self._positions(s, shown)]}
                             if req.logprobs else None),
                "finish_reason": finish,
            }
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids
            self._filter_choice(choice, choice["message"])
            choices.append(choice)
        body: dict[str, Any] = {"id": f"chatcmpl-{secrets.token_hex(12)}",
                                "object": "chat.completion", "created": int(time.time()),
                                "model": self.config.model_name, "choices": choices,
                                "usage": self._usage(lengths, results)}
        if req.return_token_ids:
            body["prompt_token_ids"] = self.policy.encode(prompt)
        return body

    @staticmethod
    def _positions(s: Sample, shown: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        tops = s.top_logprobs or [[] for _ in s.token_ids]
        return list(zip(s.token_ids[:shown], s.logprobs[:shown], tops[:shown], strict=True))

    def _chat_entry(self, token_id: int, logprob: float, alts: list[tuple[int, float]],
                    as_ids: bool) -> dict[str, Any]:
        text = self.policy.token_text(token_id)
        return {"token": self._token_name(token_id, as_ids), "logprob": logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._token_name(a, as_ids), "logprob": v,
                                  "bytes": list(self.policy.token_text(a).encode())}
                                 for a, v in alts]}

    async def completions(self, request: Request) -> Response:
        try:
            req = parse_request(CompletionRequest, await self._body(request))
            self._check_model(req.model)
            if req.best_of not in (None, req.n):
                raise ApiError("best_of must equal n (or be omitted): candidates are not "
                               "ranked by this server", param="best_of")
            if req.echo and req.logprobs is not None:
                raise ApiError("echo with logprobs is not supported (prompt tokens are not "
                               "scored)", param="echo")
            prompts = req.prompts()
            self._check_token_ids(prompts)
            params, lengths = self._params(req, prompts, req.max_tokens, req.logprobs or 0)
            self._check_n(req.n)
            if req.stream and not self._holds_streams:
                return self._stream(self._completion_stream(req, prompts, params, lengths))
            results = await self._run(prompts, req.n, params, req.seed)
        except ApiError as err:
            return _error(err)
        body = self._completion_body(req, prompts, results, lengths)
        if req.stream:
            return self._stream(self._completion_chunks(req, body))
        return JSONResponse(body, headers=self._filter_header)

    def _completion_body(self, req: CompletionRequest, prompts: list[Prompt],
                         results: list[list[Sample]], lengths: list[int]) -> dict[str, Any]:
        as_ids = req.return_tokens_as_token_ids
        choices = []
        for p, samples in enumerate(results):
            for j, s in enumerate(samples):
                choice: dict[str, Any] = {
                    "index": p * req.n + j,
                    "text": (self._prompt_text(prompts[p]) + s.text) if req.echo else s.text,
                    "logprobs": (self._completion_logprobs(
                        self._positions(s, self._shown(s, as_ids)), as_ids)
                        if req.logprobs is not None else None),
                    "finish_reason": s.finish_reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = s.token_ids
                    choice["prompt_token_ids"] = self.policy.encode(prompts[p])
                self._filter_choice(choice, choice)
                choices.append(choice)
        return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                "created": int(time.time()), "model": self.config.model_name,
                "choices": choices, "usage": self._usage(lengths, results)}

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else self.policy.decode(list(prompt))

    def _completion_logprobs(self, positions: list[tuple[int, float, list[tuple[int, float]]]],
                             as_ids: bool, start: int = 0) -> dict[str, Any]:
        """The legacy completions layout; `start`: the text offset of the first position."""
        tokens, offsets, at = [], [], start
        for token_id, _, _ in positions:
            tokens.append(self._token_name(token_id, as_ids))
            offsets.append(at)
            at += len(self.policy.token_text(token_id))
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in positions],
                "top_logprobs": [{self._token_name(a, as_ids): v for a, v in alts}
                                 for _, _, alts in positions],
                "text_offset": offsets}

    # ---- output filter ---------------------------------------------------------------------

    @property
    def _holds_streams(self) -> bool:
        """Redact and block need a choice's whole text: streams are sent once it is done."""
        return self.config.output_filter in (Mode.REDACT, Mode.BLOCK)

    @property
    def _filter_header(self) -> dict[str, str]:
        return {"x-crucible-filter": self.config.output_filter.value}

    def _filter_choice(self, choice: dict[str, Any], holder: dict[str, Any]) -> None:
        """Apply the output filter to one finished choice; ``holder`` has its text under
        "content" (chat) or "text" (completions)."""
        mode = self.config.output_filter
        if mode == Mode.OFF:
            return
        key = "content" if "content" in holder else "text"
        calls = holder.get("tool_calls") or []
        screened = screen_text(holder[key] or "", mode)
        args = [screen_text(c["function"]["arguments"], mode) for c in calls]
        kinds = list(dict.fromkeys([*screened.kinds, *(k for a in args for k in a.kinds)]))
        if not kinds:
            return
        choice["filter"] = {"action": mode.value, "kinds": kinds}
        if mode == Mode.FLAG:
            return
        holder[key] = "" if mode == Mode.BLOCK else (
            screened.value if holder[key] is not None else None)
        if mode == Mode.BLOCK:
            choice["finish_reason"] = "content_filter"
            holder.pop("tool_calls", None)
        else:  # redacted inside the JSON strings' values
            for c, a in zip(calls, args, strict=True):
                c["function"]["arguments"] = a.value
        choice["logprobs"] = None
        choice.pop("token_ids", None)

    def _flag(self, text: str) -> dict[str, Any]:
        """Under ``flag``: the `filter` field a streamed choice's last chunk carries."""
        if self.config.output_filter != Mode.FLAG:
            return {}
        kinds = screen_text(text, Mode.FLAG).kinds
        return {"filter": {"action": "flag", "kinds": list(kinds)}} if kinds else {}

    @staticmethod
    async def _chat_chunks(req: ChatCompletionRequest, body: dict[str, Any]
                           ) -> AsyncIterator[dict[str, Any]]:
        """A finished (filtered) chat completion as stream chunks: per choice its role, its
        whole text with its logprobs and token ids, its finish; then usage if asked."""
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for c in body["choices"]:
            first: dict[str, Any] = {**head, "choices": [{
                "index": c["index"], "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}]}
            if "prompt_token_ids" in body and c["index"] == 0:
                first["prompt_token_ids"] = body["prompt_token_ids"]
            yield first
            text: dict[str, Any] = {"index": c["index"],
                                    "delta": {"content": c["message"]["content"] or ""},
                                    "logprobs": c["logprobs"], "finish_reason": None}
            if "token_ids" in c:
                text["token_ids"] = c["token_ids"]
            yield {**head, "choices": [text]}
            for k, call in enumerate(c["message"].get("tool_calls") or []):
                made = ToolCall(call["id"], call["function"]["name"],
                                call["function"]["arguments"])
                for part in (Delta(call=made, index=k), Delta(call=made, index=k,
                                                              arguments=True)):
                    yield {**head, "choices": [{"index": c["index"], "delta": part.as_openai(),
                                                "logprobs": None, "finish_reason": None}]}
            last = {"index": c["index"], "delta": {}, "logprobs": None,
                    "finish_reason": c["finish_reason"]}
            if "filter" in c:
                last["filter"] = c["filter"]
            yield {**head, "choices": [last]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": body["usage"]}

    @staticmethod
    async def _completion_chunks(req: CompletionRequest, body: dict[str, Any]
                                 ) -> AsyncIterator[dict[str, Any]]:
        """A finished (filtered) completion as stream chunks: per choice its whole text
        with its logprobs and token ids, then its finish; then usage if asked."""
        head = {"id": body["id"], "object": "text_completion", "created": body["created"],
                "model": body["model"]}
        for c in body["choices"]:
            text = {k: v for k, v in c.items() if k not in ("filter", "finish_reason")}
            yield {**head, "choices": [{**text, "finish_reason": None}]}
            last = {"index": c["index"], "text": "", "logprobs": None,
                    "finish_reason": c["finish_reason"]}
            if "filter" in c:
                last["filter"] = c["filter"]
            yield {**head, "choices": [last]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": body["usage"]}

    # ---- streaming -------------------------------------------------------------------------

    def _stream(self, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", **self._filter_header})

    async def _tokens(self, prompts: list[Prompt], n: int, params: SamplingParams,
                      seed: int | None) -> AsyncIterator[TokenEvent | list[list[Sample]]]:
        """The job's tokens as they are sampled, then its finished samples."""
        queue = self._start_stream(prompts, n, params, seed)
        while True:
            kind, item = await queue.get()
            if kind == "token":
                yield item
            else:
                yield item.result()  # raises what generation raised
                return

    @staticmethod
    def _failed(exc: Exception) -> dict[str, Any]:
        """A failure after the stream began: an error event (the official client raises it)."""
        return ApiError(f"generation failed: {type(exc).__name__}: {exc}", status=500,
                        type="server_error").body()

    async def _chat_stream(self, req: ChatCompletionRequest, prompt: str,
                           params: SamplingParams, lengths: list[int], calls: ToolPlan
                           ) -> AsyncIterator[dict[str, Any]]:
        """Role first for every choice, then a chunk per sampled token as it comes (the n
        choices interleaved), then each choice's finish, then usage if asked. With tools, a
        token's text goes through the choice's tool-call parser: content as it becomes
        certain, each call as two `tool_calls` deltas (id and name, then arguments) once
        its block is complete."""
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.config.model_name}
        as_ids, eos = req.return_tokens_as_token_ids, self.policy.tok.eos_token_id
        texts = [TextStream(self.policy, list(params.stop)) for _ in range(req.n)]
        parsers = [calls.stream() for _ in range(req.n)]

        def pieces(i: int, text: str, last: bool = False) -> tuple[str, list[dict[str, Any]]]:
            """Row i's new text as (content, tool_calls deltas)."""
            parser = parsers[i]
            if parser is None:
                return text, []
            deltas = parser.push(text) + (parser.finish() if last else [])
            content = "".join(d.content or "" for d in deltas if d.call is None)
            return content, [d.as_openai() for d in deltas if d.call is not None]

        def call_chunks(i: int, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{**head, "choices": [{"index": i, "delta": d, "logprobs": None,
                                          "finish_reason": None}]} for d in deltas]
        for i in range(req.n):
            first: dict[str, Any] = {**head, "choices": [{
                "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]}
            if req.return_token_ids and i == 0:
                first["prompt_token_ids"] = self.policy.encode(prompt)
            yield first
        try:
            async for item in self._tokens([prompt], req.n, params, req.seed):
                if isinstance(item, TokenEvent):
                    is_eos = item.token_id == eos
                    delta, tool_deltas = pieces(
                        item.row, "" if is_eos else texts[item.row].push(item.token_id))
                    show = req.logprobs and (as_ids or not is_eos)
                    if delta or show or req.return_token_ids:
                        choice: dict[str, Any] = {
                            "index": item.row, "delta": {"content": delta},
                            "logprobs": ({"content": [self._chat_entry(
                                item.token_id, item.logprob, item.top_logprobs, as_ids)]}
                                if show else None),
                            "finish_reason": None}
                        if req.return_token_ids:
                            choice["token_ids"] = [item.token_id]
                        yield {**head, "choices": [choice]}
                    for chunk in call_chunks(item.row, tool_deltas):
                        yield chunk
                    continue
                results = item
        except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
            yield self._failed(exc)
            return
        for i, s in enumerate(results[0]):
            rest, tool_deltas = pieces(i, texts[i].finish(s.text), last=True)
            if rest:
                yield {**head, "choices": [{"index": i, "delta": {"content": rest},
                                            "logprobs": None, "finish_reason": None}]}
            for chunk in call_chunks(i, tool_deltas):
                yield chunk
            parser = parsers[i]
            finish = "tool_calls" if parser is not None and parser.calls else s.finish_reason
            yield {**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                        "finish_reason": finish, **self._flag(s.text)}]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": self._usage(lengths, results)}

    async def _completion_stream(self, req: CompletionRequest, prompts: list[Prompt],
                                 params: SamplingParams, lengths: list[int]
                                 ) -> AsyncIterator[dict[str, Any]]:
        """A chunk per sampled token as it comes (choices interleaved), then each choice's
        finish, then usage if asked. Choice `p * n + j` is prompt p's sample j."""
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                "created": int(time.time()), "model": self.config.model_name}
        as_ids, eos, n = req.return_tokens_as_token_ids, self.policy.tok.eos_token_id, req.n
        rows = len(prompts) * n
        texts = [TextStream(self.policy, list(params.stop)) for _ in range(rows)]
        offsets = [0] * rows
        if req.echo or req.return_token_ids:
            for r in range(rows):
                choice: dict[str, Any] = {
                    "index": r, "text": self._prompt_text(prompts[r // n]) if req.echo else "",
                    "logprobs": None, "finish_reason": None}
                if req.return_token_ids:
                    choice["prompt_token_ids"] = self.policy.encode(prompts[r // n])
                yield {**head, "choices": [choice]}
        try:
            async for item in self._tokens(prompts, n, params, req.seed):
                if isinstance(item, TokenEvent):
                    is_eos = item.token_id == eos
                    delta = "" if is_eos else texts[item.row].push(item.token_id)
                    show = req.logprobs is not None and (as_ids or not is_eos)
                    if not (delta or show or req.return_token_ids):
                        continue
                    lp = None
                    if show:
                        lp = self._completion_logprobs(
                            [(item.token_id, item.logprob, item.top_logprobs)], as_ids,
                            offsets[item.row])
                        offsets[item.row] += len(self.policy.token_text(item.token_id))
                    choice = {"index": item.row, "text": delta, "logprobs": lp,
                              "finish_reason": None}
                    if req.return_token_ids:
                        choice["token_ids"] = [item.token_id]
                    yield {**head, "choices": [choice]}
                    continue
                results = item
        except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
            yield self._failed(exc)
            return
        for p, samples in enumerate(results):
            for j, s in enumerate(samples):
                r = p * n + j
                shown = self._prompt_text(prompts[p]) if req.echo else ""
                rest = texts[r].finish(s.text)
                if rest:
                    yield {**head, "choices": [{"index": r, "text": rest, "logprobs": None,
                                                "finish_reason": None}]}
                yield {**head, "choices": [{"index": r, "text": "", "logprobs": None,
                                            "finish_reason": s.finish_reason,
                                            **self._flag(shown + s.text)}]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": self._usage(lengths, results)}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools: what its prompt renders, the text its assistant turn
    is forced to start with, and whether completions are parsed for calls."""

    renders: bool  # tools offered or tool calls in the history: the tool-aware rendering
    messages: list[dict[str, Any]]  # OpenAI-shaped, text content
    offered: list[dict[str, Any]] | None  # the tools shown to the model
    prefix: str  # appended to the prompt (tool_choice "required" or a named function)
    max_calls: int | None  # 1 under parallel_tool_calls: false

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolPlan:
        choice = req.chosen_tool()
        offered = ([t.model_dump(exclude_none=True) for t in req.tools]
                   if req.tools and choice != "none" else None)
        messages = []
        for m in req.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            messages.append(d)
        history = any(m.tool_calls or m.role == "tool" for m in req.messages)
        return cls(renders=bool(offered) or history, messages=messages, offered=offered,
                   prefix=forced_prefix(choice, bool(offered)),
                   max_calls=1 if req.parallel_tool_calls is False else None)

    def stream(self) -> ToolCallStream | None:
        """A parser for one streamed choice (None when no tools are offered)."""
        if not self.offered:
            return None
        parser = ToolCallStream(self.max_calls)
        parser.push(self.prefix)  # the forced start is part of the turn
        return parser

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """A finished choice's message and finish reason: "tool_calls" once a call parsed."""
        if not self.offered:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_completion(self.prefix + text, self.max_calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, finish_reason
        message["tool_calls"] = [c.as_openai() for c in calls]
        return message, "tool_calls"


class TextStream:
    """The text of one streamed choice, sent as it becomes final: a tail that may still turn
    into a stop string (which the full text leaves out) or that ends in half a UTF-8 character
    waits for the next token; after the last token the sample's own text settles the rest."""

    def __init__(self, policy: Policy, stops: list[str]) -> None:
        self.policy, self.stops = policy, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.policy.decode(self.ids)
        cut, hit = cut_at_stop(text, self.stops)
        return self._advance(cut if hit else text[: len(text) - self._held(text)])

    def finish(self, final: str) -> str:
        return self._advance(final)

    def _held(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))  # an unfinished multi-byte character
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def _advance(self, settled: str) -> str:
        if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
            return ""
        delta, self.sent = settled[len(self.sent):], settled
        return delta


def build_app(model_dir: str | Path, *, name: str | None = None, api_key: str | None = None,
              max_rows: int = 64, chat_format: str = "auto", device: str | None = None,
              dtype: str = "auto", engine: EngineOptions | None = None,
              rope_scaling: dict[str, Any] | None = None,
              max_model_len: int | None = None,
              output_filter: Mode | str = Mode.OFF, int8: bool = False) -> OpenAIApp:
    policy = Policy(model_dir, device=device, dtype=dtype,  # type: ignore[arg-type]
                    chat_format=chat_format,  # type: ignore[arg-type]
                    rope_scaling=rope_scaling, max_model_len=max_model_len, int8=int8)
    config = ServerConfig(model_name=name or Path(model_dir).resolve().name, api_key=api_key,
                          max_rows=max_rows, engine=engine or EngineOptions(),
                          output_filter=Mode(output_filter))
    return OpenAIApp(policy, config)


class RunningServer:
    """A server on a background thread. `url` is the OpenAI base URL (`.../v1`)."""

    def __init__(self, oa: OpenAIApp, server: uvicorn.Server, thread: threading.Thread,
                 url: str) -> None:
        self.openai_app, self._server, self._thread, self.url = oa, server, thread, url

    @property
    def model_name(self) -> str:
        return self.openai_app.config.model_name

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.openai_app.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, even before uvicorn accepts them
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _uvicorn(app: Starlette, log_level: str) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                         lifespan="off", timeout_graceful_shutdown=5))


def start_server(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 60.0, log_level: str = "warning",
                 **options: Any) -> RunningServer:
    """Load the policy and serve it on a background thread; port 0 picks a free port.

    Returns once the server accepts connections. `options` go to `build_app` (name, api_key,
    max_rows, chat_format, device, dtype, engine, rope_scaling, max_model_len, output_filter,
    int8).
    """
    oa = build_app(model_dir, **options)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    server = _uvicorn(oa.app, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"inference-server-{bound}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            oa.close()
            sock.close()
            raise RuntimeError(f"the inference server on {host}:{bound} did not start")
        time.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    return RunningServer(oa, server, thread, f"http://{shown}:{bound}/v1")


def serve_forever(model_dir: str | Path, *, host: str, port: int,
                  on_ready: Callable[[str], None] | None = None, **options: Any) -> None:
    """Foreground server for the CLI; Ctrl-C / SIGTERM stop it."""
    oa = build_app(model_dir, **options)
    sock = _bind(host, port)
    if on_ready:
        on_ready(f"http://{host}:{sock.getsockname()[1]}/v1")
    try:
        _uvicorn(oa.app, "info").run(sockets=[sock])
    finally:
        oa.close()
