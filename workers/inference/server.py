"""OpenAI-compatible HTTP routes (Starlette) over a `Batcher`, and ways to run them.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /health`. Streaming (`stream: true`) is answered in the SSE
chunk format OpenAI clients parse; the text arrives in one chunk per choice once it is
generated, because the rollout path samples a whole batch at a time.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
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
from workers.inference.engine import Batcher, Policy, Sample, SamplingParams
from workers.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)

DEFAULT_CHAT_MAX_TOKENS = 256  # when a chat request names no limit (also capped by context)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_rows: int = 64  # sequences per generation batch


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class OpenAIApp:
    """The Starlette app and the request handling it needs (validation, limits, rendering)."""

    def __init__(self, policy: Policy, config: ServerConfig) -> None:
        self.policy, self.config = policy, config
        self.batcher = Batcher(policy, config.max_rows)
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

    def _params(self, req: ChatCompletionRequest | CompletionRequest, prompts: list[str],
                limit: int | None, top: int) -> tuple[SamplingParams, list[int]]:
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
        temperature = 1.0 if req.temperature is None else req.temperature
        params = SamplingParams(temperature=temperature,
                                top_p=1.0 if req.top_p is None else req.top_p,
                                max_tokens=limit, stop=tuple(req.stops()), top_logprobs=top)
        return params, lengths

    async def _run(self, prompts: list[str], n: int, params: SamplingParams,
                   seed: int | None) -> list[list[Sample]]:
        fut = self.batcher.submit(prompts, n, params, seed)
        return await asyncio.wrap_future(fut)

    @staticmethod
    def _usage(lengths: list[int], results: list[list[Sample]]) -> dict[str, int]:
        prompt = sum(lengths)
        completion = sum(len(s.token_ids) for samples in results for s in samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # ---- routes ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.config.model_name,
                             "threads": threads.in_use()["torch_threads"]})

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
            try:
                prompt = self.policy.render_chat([(m.role, m.text()) for m in req.messages])
            except ValueError as exc:
                raise ApiError(str(exc), param="messages") from None
            top = (req.top_logprobs or 0) if req.logprobs else 0
            if req.top_logprobs and not req.logprobs:
                raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
            params, lengths = self._params(req, [prompt], req.limit(), top)
            results = await self._run([prompt], req.n, params, req.seed)
        except ApiError as err:
            return _error(err)
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        choices = []
        for i, s in enumerate(results[0]):
            choice: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": s.text},
                "logprobs": {"content": self._chat_logprobs(s)} if req.logprobs else None,
                "finish_reason": s.finish_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        body: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created,
                                "model": self.config.model_name, "choices": choices,
                                "usage": self._usage(lengths, results)}
        if req.return_token_ids:
            body["prompt_token_ids"] = self.policy.encode(prompt)
        if req.stream:
            return self._stream(self._chat_chunks(body, req))
        return JSONResponse(body)

    def _chat_logprobs(self, s: Sample) -> list[dict[str, Any]]:
        out = []
        for j, (tid, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            text = self.policy.token_text(tid)
            alts = [{"token": (t := self.policy.token_text(a)), "logprob": v,
                     "bytes": list(t.encode())} for a, v in (s.top_logprobs[j]
                                                             if s.top_logprobs else [])]
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": alts})
        return out

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
            params, lengths = self._params(req, prompts, req.max_tokens, req.logprobs or 0)
            results = await self._run(prompts, req.n, params, req.seed)
        except ApiError as err:
            return _error(err)
        choices = []
        for p, samples in enumerate(results):
            for j, s in enumerate(samples):
                choice: dict[str, Any] = {
                    "index": p * req.n + j,
                    "text": (prompts[p] + s.text) if req.echo else s.text,
                    "logprobs": (self._completion_logprobs(s, req.logprobs)
                                 if req.logprobs is not None else None),
                    "finish_reason": s.finish_reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = s.token_ids
                    choice["prompt_token_ids"] = self.policy.encode(prompts[p])
                choices.append(choice)
        body = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                "created": int(time.time()), "model": self.config.model_name,
                "choices": choices, "usage": self._usage(lengths, results)}
        if req.stream:
            return self._stream(self._completion_chunks(body, req))
        return JSONResponse(body)

    def _completion_logprobs(self, s: Sample, k: int) -> dict[str, Any]:
        tokens = [self.policy.token_text(t) for t in s.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top = ([{self.policy.token_text(a): v for a, v in alts} for alts in s.top_logprobs]
               if k else None)
        return {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": top,
                "text_offset": offsets}

    # ---- streaming -------------------------------------------------------------------------

    @staticmethod
    def _stream(chunks: list[dict[str, Any]]) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @staticmethod
    def _chat_chunks(body: dict[str, Any], req: ChatCompletionRequest) -> list[dict[str, Any]]:
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        chunks = []
        for c in body["choices"]:
            first = {"index": c["index"], "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
            text = {"index": c["index"], "delta": {"content": c["message"]["content"]},
                    "logprobs": c["logprobs"], "finish_reason": None}
            if "token_ids" in c:
                text["token_ids"] = c["token_ids"]
            last = {"index": c["index"], "delta": {}, "logprobs": None,
                    "finish_reason": c["finish_reason"]}
            chunks += [{**head, "choices": [x]} for x in (first, text, last)]
        if req.stream_options and req.stream_options.include_usage:
            chunks.append({**head, "choices": [], "usage": body["usage"]})
        return chunks

    @staticmethod
    def _completion_chunks(body: dict[str, Any],
                           req: CompletionRequest) -> list[dict[str, Any]]:
        head = {"id": body["id"], "object": "text_completion", "created": body["created"],
                "model": body["model"]}
        chunks = []
        for c in body["choices"]:
            chunks.append({**head, "choices": [{**c, "finish_reason": None}]})
            chunks.append({**head, "choices": [{"index": c["index"], "text": "",
                                                "logprobs": None,
                                                "finish_reason": c["finish_reason"]}]})
        if req.stream_options and req.stream_options.include_usage:
            chunks.append({**head, "choices": [], "usage": body["usage"]})
        return chunks


def build_app(model_dir: str | Path, *, name: str | None = None, api_key: str | None = None,
              max_rows: int = 64, chat_format: str = "auto", device: str | None = None,
              dtype: str = "auto") -> OpenAIApp:
    policy = Policy(model_dir, device=device, dtype=dtype,  # type: ignore[arg-type]
                    chat_format=chat_format)  # type: ignore[arg-type]
    config = ServerConfig(model_name=name or Path(model_dir).resolve().name, api_key=api_key,
                          max_rows=max_rows)
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
    max_rows, chat_format, device, dtype).
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
