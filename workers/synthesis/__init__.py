"""Data synthesis: seeded generators, staged verification, dedup and diversity (no Django).

Entry point: `synthesize(config, progress_callback) -> Batch` with a `spec.SynthesisConfig`.
The engine is imported lazily, so `import workers.synthesis.spec` (the API's validation) loads
pydantic only.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Batch": "pipeline", "ItemProgress": "pipeline", "Progress": "pipeline",
    "SynthesisError": "pipeline",
    "synthesize": "pipeline",
    "SynthesisConfig": "spec", "SynthesizeRunConfig": "spec", "SpecError": "spec",
    "parse_config": "spec", "parse_run_config": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
