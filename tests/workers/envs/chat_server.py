"""A scripted OpenAI-compatible chat server over real HTTP (stdlib `http.server` in a thread),
for tests that drive `EndpointPolicy` the way an eval run does: each POST to
`/v1/chat/completions` is recorded and answered by `script(body)`, which returns the assistant
message (`content`, `tool_calls`), or a whole response object under the key "raw"."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Script = Callable[[dict[str, Any]], dict[str, Any]]
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def tool_call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


class ChatServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                answer = server.script(body)
                payload = answer["raw"] if "raw" in answer else {
                    "id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason":
                                 "tool_calls" if answer.get("tool_calls") else "stop",
                                 "message": {"role": "assistant", "content": None, **answer}}],
                    "usage": USAGE}
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@contextmanager
def chat_server(script: Script) -> Iterator[ChatServer]:
    server = ChatServer(script)
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join()
