"""Output filtering: find secrets and personal data in text a model wrote, and apply a
policy to it (off, flag, redact, block).

Pure Python over `detect-secrets` (no Django, no ML library, no other engine), so the web
apps (stored samples, dataset exports) and the policy server (served completions) share one
detector. See docs/filtering.md.
"""

from workers.filtering.detect import (
    KINDS,
    Finding,
    Mode,
    Screened,
    find,
    kinds_of,
    redact,
    screen_text,
    screen_value,
)

__all__ = ["KINDS", "Finding", "Mode", "Screened", "find", "kinds_of", "redact", "screen_text",
           "screen_value"]
