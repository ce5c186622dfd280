"""In-sandbox bootstraps, shipped as source text and started as `python3 -c` / `node -e`.

They are never imported by the engine: the sandbox has no access to this repository.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The bootstrap's text, e.g. source("python_boot.py")."""
    return (_HERE / name).read_text()
