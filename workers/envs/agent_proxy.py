"""Train an existing agent program: a recording proxy between it and the policy server.

An agent program (anything built on the official `openai` client) runs inside a sandbox
session of a terminal task with the proxy as its model endpoint. Every chat completion it asks
for goes through the proxy, which

- rewrites or blocks tool results the environment declares unsafe (`ToolResultRule`) before
  the policy sees them, and records that it did;
- asks the policy server for what training needs whatever the agent asked for: the prompt's
  token ids, the sampled ids (eos included) and their logprobs (`return_token_ids`,
  `return_tokens_as_token_ids`, `logprobs`), and answers the agent in the shape it asked for;
- records each call (`ModelCall`): the messages as the policy saw them, the sampling
  parameters, the token ids and logprobs the *server* returned.

When the program exits, the task's trusted grader runs the hidden tests on a fork of the
session's final workspace (`grade_session`), and the calls become RL episodes
(`workers.envs.rollout.Episode`, `segments`): a call whose prompt extends the previous call's
prompt and sampled tokens continues that episode (the new prompt tokens, tool results among
them, enter with loss mask 0); a call whose prompt does not (the agent rewrote or trimmed its
history, or the chat format renders a past turn differently from how it was sampled) starts a
new episode. The loss mask is 1 exactly on the tokens the server sampled.

Why this shape:

- **No network in the sandbox.** A session's seccomp filter allows only AF_UNIX sockets. The
  proxy listens on a unix socket in a per-episode folder the session gets read-only at
  `/crucible/agent` (with the agent program and a `sitecustomize.py` that routes httpx over the
  socket, `agent_harness/`), and the `openai` package comes read-only from
  `scripts/install_sandbox_deps.sh`'s folder at `/crucible/python`. The base URL the agent
  gets (`OPENAI_BASE_URL=http://crucible-proxy/v1`) names no reachable host.
- **Nothing the agent says is recorded as the policy's.** The agent only talks HTTP over its
  socket; token ids and logprobs come from the server's reply, never from the agent's request
  (a forged assistant turn in its history is prompt, mask 0, and breaks the episode there);
  the socket is the episode's identity (one socket per session); the server's API key stays on
  the host; the reward is the grader's, on the workspace, after every process of the session
  was killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

import httpx

from workers.envs.rollout import Episode
from workers.envs.terminal.grader import CLEAN_ENV, GradeResult, grade_session
from workers.envs.terminal.task import TerminalTask
from workers.sandbox import sessions
from workers.sandbox.sessions import Session, SessionManager
from workers.sandbox.spec import SessionExec, SessionStatus

PYTHON_DIR = Path(os.environ.get("CRUCIBLE_SANDBOX_OPENAI_DIR", "")
                  or "/opt/crucible/sandbox-toolchains/python-openai")
"""The openai client for the sandbox's Python (scripts/install_sandbox_deps.sh installs it)."""
INSIDE = "/crucible/agent"  # the episode's folder inside the session (socket, shim, program)
INSIDE_PYTHON = "/crucible/python"
SOCKET = "model.sock"
BASE_URL = "http://crucible-proxy/v1"
MAX_BODY = 16 << 20
MAX_CONNECTIONS = 16
IDLE_S = 120.0
BLOCKED = "[tool result blocked by the environment: {rule}]"


class AgentProxyError(RuntimeError):
    """The proxy or its episode could not be set up (not the agent's fault)."""


# ---- unsafe tool results ------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolResultRule:
    """A rule the environment declares over tool results (messages of `roles`): `pattern` (a
    regular expression) or `check` (text -> whether it is unsafe). `block` replaces the whole
    message with a notice naming the rule; `rewrite` replaces each match of `pattern` with
    `replacement` (or, with `check`, the whole text by `replacement`)."""

    name: str
    action: Literal["block", "rewrite"] = "block"
    pattern: str | None = None
    check: Callable[[str], bool] | None = None
    replacement: str = "[removed by the environment]"
    roles: tuple[str, ...] = ("tool",)

    def __post_init__(self) -> None:
        if (self.pattern is None) == (self.check is None):
            raise ValueError(f"tool-result rule {self.name!r}: give exactly one of pattern, check")
        if self.action not in ("block", "rewrite"):
            raise ValueError(f"tool-result rule {self.name!r}: action is 'block' or 'rewrite'")
        if self.pattern is not None:
            re.compile(self.pattern)

    def apply(self, text: str) -> str | None:
        """The text the policy sees instead, or None when the rule does not match."""
        if self.pattern is not None:
            rx = re.compile(self.pattern)
            if rx.search(text) is None:
                return None
            return BLOCKED.format(rule=self.name) if self.action == "block" else \
                rx.sub(self.replacement, text)
        assert self.check is not None
        if not self.check(text):
            return None
        return BLOCKED.format(rule=self.name) if self.action == "block" else self.replacement


@dataclass(frozen=True)
class GuardEvent:
    """A tool result the proxy changed: where it first appeared, which rule, and a digest of
    the original (the unsafe text itself is not kept)."""

    call: int
    message: int
    tool_call_id: str | None
    rule: str
    action: str
    original_sha256: str
    original_chars: int


def guard_messages(messages: list[dict[str, Any]], rules: Sequence[ToolResultRule]
                   ) -> tuple[list[dict[str, Any]], list[tuple[int, str, str, str]]]:
    """Messages with the rules applied (the first matching rule per message; text parts of a
    list content each), and per changed message (index, rule, action, original text). Pure:
    the same history gives the same rewrite on every call, so the policy's context stays a
    prefix of the next one."""
    out: list[dict[str, Any]] = []
    changed: list[tuple[int, str, str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in {r for rule in rules
                                                            for r in rule.roles}:
            out.append(m)
            continue
        content = m.get("content")
        texts = [content] if isinstance(content, str) else \
            [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) \
            else []
        original = "".join(t for t in texts if isinstance(t, str))
        for rule in rules:
            if m["role"] not in rule.roles:
                continue
            if isinstance(content, str):
                new: Any = rule.apply(content)
            elif isinstance(content, list):
                parts = [{**p, "text": rule.apply(p["text"])}
                         if isinstance(p, dict) and isinstance(p.get("text"), str)
                         and rule.apply(p["text"]) is not None else p for p in content]
                new = parts if parts != content else None
            else:
                new = None
            if new is not None:
                out.append({**m, "content": new})
                changed.append((i, rule.name, rule.action, original))
                break
        else:
            out.append(m)
    return out, changed


# ---- what is recorded ---------------------------------------------------------------------------

@dataclass
class ModelCall:
    """One chat completion as the server made it. `token_ids` and `logprobs` are the server's
    (aligned, the final eos included); `trainable` is False when the server withheld them
    (its output filter) or the call failed."""

    index: int
    messages: list[dict[str, Any]]  # as the policy saw them (rules applied)
    tools: list[dict[str, Any]] | None
    params: dict[str, Any]  # the sampling fields sent (model, temperature, logit_bias, ...)
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reply: dict[str, Any] | None = None  # the assistant message
    finish_reason: str | None = None
    trainable: bool = False
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "index", "messages", "tools", "params", "prompt_ids", "token_ids", "logprobs",
            "reply", "finish_reason", "trainable", "error")}


def segments(calls: Sequence[ModelCall], task_id: str) -> list[Episode]:
    """The calls as trainable episodes (see the module docstring): a call continues the
    current episode when its prompt ids start with all of the episode's ids, else starts one;
    an untrainable call ends the current one."""
    out: list[Episode] = []
    cur: Episode | None = None
    for c in calls:
        if not c.trainable:
            cur = None
            continue
        if cur is not None and c.prompt_ids[: len(cur.token_ids)] == cur.token_ids:
            cur.extend(c.prompt_ids[len(cur.token_ids):], sampled=False)
        else:
            cur = Episode(task_id=task_id)
            cur.extend(c.prompt_ids, sampled=False)
            cur.prompt_len = len(c.prompt_ids)
            out.append(cur)
        cur.extend(c.token_ids, sampled=True, logprobs=c.logprobs)
        cur.turns += 1
        cur.messages = cast(list[dict[str, str]],
                            [*c.messages, *([c.reply] if c.reply is not None else [])])
    return out


# ---- the proxy ----------------------------------------------------------------------------------

class _ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {"error": {"message": message, "type": "invalid_request_error",
                                       "param": param, "code": code}}


class _Server(socketserver.ThreadingUnixStreamServer):
    """One thread per connection, at most MAX_CONNECTIONS at once (a connection beyond is
    closed at once): the agent cannot make the host start threads without bound."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 64
    proxy: RecordingProxy

    def __init__(self, path: str) -> None:
        super().__init__(path, _Handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.slots.acquire(blocking=False)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S  # a connection that sends nothing for this long is dropped
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        return

    def address_string(self) -> str:
        return "agent"

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        proxy = self.server.proxy
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [proxy.model_card()]})
        elif path.startswith(("/v1/models/", "/models/")):
            self._json(200, {**proxy.model_card(), "id": path.rsplit("/", 1)[1]})
        else:
            self._json(404, _ApiError(404, f"unknown route GET {path}").body)

    def do_POST(self) -> None:  # noqa: N802
        proxy = self.server.proxy
        path = self.path.split("?")[0].rstrip("/")
        try:
            if path not in ("/v1/chat/completions", "/chat/completions"):
                raise _ApiError(404, f"unknown route POST {path}: the recording proxy serves "
                                     "POST /v1/chat/completions and GET /v1/models")
            size = self.headers.get("Content-Length")
            if size is None or not size.isdigit():
                raise _ApiError(411, "send the request body with a Content-Length")
            if int(size) > MAX_BODY:
                raise _ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
            try:
                body = json.loads(self.rfile.read(int(size)))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _ApiError(400, f"the request body is not valid JSON: {exc}") from None
            reply, stream = proxy.chat(body)
        except _ApiError as err:
            self._json(err.status, err.body)
            return
        except Exception as exc:  # a malformed upstream reply: the agent gets an answer
            self._json(502, _ApiError(502, f"the recording proxy failed: "
                                           f"{type(exc).__name__}: {exc}").body)
            return
        if stream is None:
            self._json(200, reply)
        else:
            self._send(200, _sse(reply, stream), "text/event-stream")


def _sse(body: dict[str, Any], include_usage: bool) -> bytes:
    """A finished chat completion as the stream chunks an OpenAI client parses."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}
    chunks: list[dict[str, Any]] = []
    for c in body["choices"]:
        msg = c["message"]
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {
            "role": "assistant", "content": msg.get("content") or ""},
            "logprobs": c.get("logprobs"), "finish_reason": None}]})
        for k, call in enumerate(msg.get("tool_calls") or []):
            chunks.append({**head, "choices": [{"index": c["index"], "delta": {"tool_calls": [
                {"index": k, **call}]}, "logprobs": None, "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {},
                                            "logprobs": None,
                                            "finish_reason": c["finish_reason"]}]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body.get("usage")})
    return b"".join(b"data: " + json.dumps(ch).encode() + b"\n\n" for ch in chunks) + \
        b"data: [DONE]\n\n"


def _agent_logprobs(choice: dict[str, Any], shown: int, top: int) -> dict[str, Any]:
    """The server's token-id view of logprobs as the text view an agent asked for: token
    text from its bytes, the eos (a stop signal, not text) left out, top alternatives only
    when asked."""
    def text(e: dict[str, Any]) -> str:
        return bytes(e.get("bytes") or []).decode("utf-8", "replace")

    entries = (choice.get("logprobs") or {}).get("content") or []
    return {"content": [{"token": text(e), "logprob": e["logprob"], "bytes": e.get("bytes"),
                         "top_logprobs": [{"token": text(a), "logprob": a["logprob"],
                                           "bytes": a.get("bytes")}
                                          for a in (e.get("top_logprobs") or [])][:top]}
                        for e in entries[:shown]]}


class RecordingProxy:
    """One episode's proxy: a unix socket in `folder`, forwarding to the policy server at
    `upstream` (its OpenAI base URL) with the host's `api_key`, recording every call.

    `model` replaces whatever model name the agent sends. `pin` fields override the agent's
    (e.g. {"temperature": 1.0} so the run's sampling, not the agent's, produces the episode).
    `max_calls` and `deadline` (time.monotonic()) bound the episode: later calls are refused
    with an error the agent sees. Calls are served one at a time, in arrival order."""

    def __init__(self, upstream: str, model: str, *, api_key: str | None = None,
                 rules: Sequence[ToolResultRule] = (), pin: dict[str, Any] | None = None,
                 max_calls: int = 50, deadline: float | None = None,
                 timeout_s: float = 600.0) -> None:
        self.upstream, self.model, self.rules = upstream.rstrip("/"), model, tuple(rules)
        self.pin = dict(pin or {})
        self.max_calls, self.deadline = max_calls, deadline
        self.calls: list[ModelCall] = []
        self.guard_events: list[GuardEvent] = []
        self.refused: list[str] = []
        self._seen: set[tuple[str | None, str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.upstream, headers=headers, timeout=timeout_s,
                                  trust_env=False)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.folder: Path | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self, folder: Path) -> Path:
        """Listen on `folder`/model.sock (the folder is created; the socket is world-writable:
        the session's uid must connect, and only that session is lent the folder)."""
        if len(os.fsencode(folder / SOCKET)) > 107:
            raise AgentProxyError(f"the socket path {folder / SOCKET} is longer than a unix "
                                  "socket address allows (107 bytes): use a shorter "
                                  "CRUCIBLE_SANDBOX_SESSIONS")
        folder.mkdir(mode=0o755, parents=False)
        os.chmod(folder, 0o755)
        self.folder = folder
        path = folder / SOCKET
        server = _Server(str(path))
        server.proxy = self
        os.chmod(path, 0o666)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="agent-proxy", daemon=True)
        self._thread.start()
        return path

    def close(self) -> None:
        """Refuse further calls and stop listening (idempotent)."""
        with self._lock:
            self._closed = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._http.close()

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "crucible"}

    # -- one call --------------------------------------------------------------------------------

    def chat(self, body: Any) -> tuple[dict[str, Any], bool | None]:
        """The agent's request -> (the reply for the agent, None or the stream's include_usage
        when it asked to stream)."""
        if not isinstance(body, dict):
            raise _ApiError(400, "the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise _ApiError(400, "messages must be a non-empty list of message objects",
                            param="messages")
        if body.get("n", 1) not in (1, None):
            raise _ApiError(400, "n must be 1: an episode is one trajectory", param="n")
        with self._lock:
            if self._closed:
                raise _ApiError(503, "the episode is over: the recording proxy is closed")
            if len(self.calls) >= self.max_calls:
                self.refused.append("max_calls")
                raise _ApiError(429, f"the episode's budget of {self.max_calls} model calls is "
                                     "spent", code="max_calls")
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.refused.append("time_budget")
                raise _ApiError(429, "the episode's time budget is spent", code="time_budget")
            return self._forward(body, messages)

    def _forward(self, body: dict[str, Any], messages: list[dict[str, Any]]
                 ) -> tuple[dict[str, Any], bool | None]:
        index = len(self.calls)
        guarded, changed = guard_messages(messages, self.rules)
        for i, rule, action, original in changed:
            digest = hashlib.sha256(original.encode()).hexdigest()
            call_id = guarded[i].get("tool_call_id")
            if (call_id, digest) not in self._seen:  # a history re-sends it every call
                self._seen.add((call_id, digest))
                self.guard_events.append(GuardEvent(index, i, call_id, rule, action, digest,
                                                    len(original)))
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        wants_logprobs = bool(body.get("logprobs"))
        asked_top = body.get("top_logprobs")
        top = asked_top if isinstance(asked_top, int) else 0
        wants_ids = bool(body.get("return_token_ids"))
        req = {k: v for k, v in body.items() if k not in (
            "stream", "stream_options", "return_token_ids", "return_tokens_as_token_ids")}
        req.update(self.pin)
        req.update(model=self.model, messages=guarded, logprobs=True, return_token_ids=True,
                   return_tokens_as_token_ids=True)
        tools = req.get("tools") if isinstance(req.get("tools"), list) else None
        params = {k: v for k, v in req.items() if k not in ("messages", "tools")}
        call = ModelCall(index, guarded, tools, params)
        self.calls.append(call)
        try:
            resp = self._http.post("/chat/completions", json=req)
        except httpx.HTTPError as exc:
            call.error = f"the policy server is unreachable: {exc}"
            raise _ApiError(502, call.error) from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code != 200 or not isinstance(data, dict):
            call.error = f"the policy server answered {resp.status_code}"
            raise _ApiError(resp.status_code if resp.status_code >= 400 else 502, call.error,
                            body=data if isinstance(data, dict) else None)
        choice = data["choices"][0]
        call.reply, call.finish_reason = choice.get("message"), choice.get("finish_reason")
        ids = choice.get("token_ids")
        entries = (choice.get("logprobs") or {}).get("content")
        prompt = data.get("prompt_token_ids")
        if isinstance(ids, list) and isinstance(entries, list) and isinstance(prompt, list) \
                and len(entries) == len(ids) and all(
                    e.get("token") == f"token_id:{t}" for e, t in zip(entries, ids, strict=True)):
            call.prompt_ids, call.token_ids = list(prompt), list(ids)
            call.logprobs = [float(e["logprob"]) for e in entries]
            call.trainable = True
        else:
            call.error = "the server withheld token ids or logprobs (output filter)"
        shown = int((data.get("usage") or {}).get("completion_tokens", len(ids or [])))
        out = {k: v for k, v in data.items() if k != "prompt_token_ids"}
        agent_choice = {k: v for k, v in choice.items() if k != "token_ids"}
        agent_choice["logprobs"] = _agent_logprobs(choice, shown, top) if wants_logprobs \
            else None
        if wants_ids and "token_ids" in choice:
            agent_choice["token_ids"] = choice["token_ids"]
            out["prompt_token_ids"] = data.get("prompt_token_ids")
        out["choices"] = [agent_choice]
        return out, (include_usage if stream else None)


# ---- an episode ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentProgram:
    """The program to train: `files` (path -> text, under /crucible/agent/program inside the
    session, read-only: the policy's tool calls cannot edit the agent) and the shell
    `command` that runs it in /work. `env` is added to its environment."""

    files: dict[str, str]
    command: str
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None  # default: the task's time budget


@dataclass
class AgentEpisodeResult:
    """One played episode: `segments` are what the trainer takes (each scored with the
    grade), `calls` and `guard_events` the record, `exit` the program's ExecResult (json)."""

    task_id: str
    segments: list[Episode]
    calls: list[ModelCall]
    guard_events: list[GuardEvent]
    grade: GradeResult
    stop_reason: str  # done | agent_error | time_budget | max_calls | lost
    exit: dict[str, Any]
    seconds: float

    @property
    def infra(self) -> bool:
        """Not the policy's doing: to retry or drop, never train on as a 0."""
        return self.grade.infra or self.stop_reason == "lost"

    def tool_results(self) -> list[dict[str, Any]]:
        """Each tool result as the policy saw it (rules applied), once, with the index of the
        call whose request first carried it."""
        seen: set[tuple[Any, str]] = set()
        out = []
        for c in self.calls:
            for m in c.messages:
                if m.get("role") != "tool":
                    continue
                key = (m.get("tool_call_id"), json.dumps(m.get("content"), sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    out.append({"call": c.index, **m})
        return out


def _episode_folder() -> Path:
    parent = sessions.BASE / "agent"
    parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(parent, 0o711)
    return parent / f"{os.getpid()}-{secrets.token_hex(12)}"  # swept once this pid is gone


def _lay_out(folder: Path, program: AgentProgram) -> None:
    shim = folder / "python"
    shim.mkdir(mode=0o755)
    source = (resources.files("workers.envs.agent_harness") / "sitecustomize.py").read_text()
    (shim / "sitecustomize.py").write_text(source)
    prog = folder / "program"
    prog.mkdir(mode=0o755)
    for rel, text in program.files.items():
        dest = (prog / rel).resolve()
        if not dest.is_relative_to(prog.resolve()) or rel.startswith("/"):
            raise ValueError(f"agent program file {rel!r} leaves the program folder")
        dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        dest.write_text(text)
        os.chmod(dest, 0o644)
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in files:
            if name != SOCKET:
                os.chmod(os.path.join(dirpath, name), 0o644)


def run_agent_episode(
    manager: SessionManager, task: TerminalTask, program: AgentProgram, *, upstream: str,
    model: str, api_key: str | None = None, rules: Sequence[ToolResultRule] = (),
    pin: dict[str, Any] | None = None, snapshot_id: str | None = None,
    python_dir: Path | None = None,
) -> AgentEpisodeResult:
    """Run `program` in a session of `task` (a fork of `snapshot_id`, else a fresh workspace)
    with the recording proxy in front of the policy server at `upstream`, grade the final
    workspace with the task's hidden tests, and build the episode."""
    started = time.monotonic()
    pydir = python_dir or PYTHON_DIR
    if not (pydir / "openai").is_dir():
        raise AgentProxyError(f"the openai client for the sandbox's Python is not at {pydir}: "
                              "run scripts/install_sandbox_deps.sh")
    budget = min(task.time_budget_s, program.timeout_s or task.time_budget_s, 3600.0)
    proxy = RecordingProxy(upstream, model, api_key=api_key, rules=rules, pin=pin,
                           max_calls=task.max_turns, deadline=started + budget)
    folder = _episode_folder()
    session: Session | None = None
    try:
        proxy.start(folder)
        _lay_out(folder, program)
        binds = ((str(folder), INSIDE), (str(pydir), INSIDE_PYTHON))
        if snapshot_id is None:
            session = manager.create(task.limits, files=task.workspace(), binds=binds)
        else:
            session = manager.fork(snapshot_id, task.limits, binds=binds)
        env = {**CLEAN_ENV, "OPENAI_BASE_URL": BASE_URL, "OPENAI_API_KEY": "crucible-proxy",
               "CRUCIBLE_MODEL_SOCKET": f"{INSIDE}/{SOCKET}",
               "PYTHONPATH": f"{INSIDE}/python:{INSIDE_PYTHON}", **program.env}
        try:
            result = session.exec(SessionExec(cmd=program.command, timeout_s=budget, env=env,
                                              output_bytes=1 << 20))
        except sessions.SessionClosed as exc:  # gone before the program started
            result = sessions.ExecResult(status=SessionStatus.LOST,
                                         message=f"the session closed: {exc.reason}")
        proxy.close()  # a background process of the agent gets no more completions
        if result.status == SessionStatus.LOST:
            stop = "lost"
        elif "max_calls" in proxy.refused:
            stop = "max_calls"
        elif result.status == SessionStatus.TLE or "time_budget" in proxy.refused:
            stop = "time_budget"
        else:
            stop = "done" if result.status == SessionStatus.OK else "agent_error"
        grade = grade_session(session, dict(task.hidden_tests), task.test_timeout_s)
    finally:
        proxy.close()
        if session is not None and session.closed_reason is None:
            session.close("episode over")
        shutil.rmtree(folder, ignore_errors=True)
    score = grade.as_score()
    if stop == "lost" and score.infra is None:
        score.infra = f"the agent's session was lost: {result.message}"
    segs = segments(proxy.calls, task.id)
    for seg in segs:  # a void episode (infra) is dropped or retried, never trained on as a 0
        seg.score = score
        seg.stop_reason = "infra" if score.infra else \
            "max_turns" if stop == "max_calls" else "done"
        seg.infra = score.infra
    return AgentEpisodeResult(task.id, segs, proxy.calls, proxy.guard_events, grade, stop,
                              result.as_json(), time.monotonic() - started)


__all__ = ["AgentEpisodeResult", "AgentProgram", "AgentProxyError", "GuardEvent", "ModelCall",
           "RecordingProxy", "ToolResultRule", "guard_messages", "run_agent_episode",
           "segments"]
