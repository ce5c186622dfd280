"""Loaded by the sandbox's Python at start-up (it is first on the agent's PYTHONPATH): routes
every `httpx` client of the process over the recording proxy's unix socket.

A session's seccomp filter allows only AF_UNIX sockets (no TCP, not even loopback), so an
unmodified program that builds `openai.OpenAI()` from `OPENAI_BASE_URL` could not connect.
When `CRUCIBLE_MODEL_SOCKET` is set, `httpx.HTTPTransport` and `httpx.AsyncHTTPTransport`
default to that socket (`uds=`): the URL's host is then a name only, the socket is the route.
httpx is patched when the program imports it, not before (a tool command that never imports
it pays nothing). Standard library only: this runs before anything else in the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_SOCKET = os.environ.get("CRUCIBLE_MODEL_SOCKET", "")
_NAMES = ("httpx", "httpx2")  # openai 2.x imports httpx; later versions a renamed fork


def _patch(module: Any) -> None:
    for name in ("HTTPTransport", "AsyncHTTPTransport"):
        cls = getattr(module, name, None)
        if cls is None or getattr(cls, "_crucible_uds", False):
            continue
        original = cls.__init__

        def init(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> None:
            if kwargs.get("uds") is None:
                kwargs["uds"] = _SOCKET
            _original(self, *args, **kwargs)

        cls.__init__ = init
        cls._crucible_uds = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _NAMES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _SOCKET:
    sys.meta_path.insert(0, _Finder())
