"""Environment QC before training (no Django): `run_qc(env, QcSpec())` or `run_qc_spec(spec)`
returns a JSON report; `workers.qc.spec.QcSpec` is the pure schema the API validates."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {"run_qc": "run", "run_qc_spec": "run", "QcSpec": "spec"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
