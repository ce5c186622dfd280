"""Sandboxed code execution: the reward oracle for code (no Django).

Entry points: `execute(request)`, `execute_batch(requests, concurrency)`, or an `Engine` of your
own (it owns the warm pools); request and result models live in `spec`. The engine is imported
lazily, so `import workers.sandbox.spec` (the API's validation) loads pydantic models only.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Engine": "runner", "EngineConfig": "runner", "default_engine": "runner",
    "execute": "runner", "execute_batch": "runner",
    "ExecutionRequest": "spec", "ExecutionResult": "spec", "Limits": "spec", "Status": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
