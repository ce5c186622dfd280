"""The detector and the policy modes.

Secrets come from `detect-secrets` (Yelp): every one of its regex-based plugins (AWS, GitHub,
GitLab, OpenAI, Slack, Stripe, private keys, JSON web tokens, basic-auth URLs, …). Its
high-entropy and keyword plugins are left out: on prose and code a model writes they fire
on ordinary words (measured in docs/filtering.md), and its public-IP plugin too (an IP
address in an answer about networking is not a leak). detect-secrets reports secret
*values*, not positions, so the spans come from running each plugin's own compiled
``denylist`` patterns with ``finditer``.

E-mail addresses use one pattern of our own: detect-secrets has none, and the PII libraries
that do (presidio-analyzer, scrubadub) bring spaCy (~390 MB) and, for presidio's e-mail
recogniser, a public-suffix-list download at first use (docs/filtering.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector


class Mode(StrEnum):
    """What a surface does with text that has findings."""

    OFF = "off"  # no scan
    FLAG = "flag"  # keep the text as it is; record what was found
    REDACT = "redact"  # replace each finding with [REDACTED:<kind>]
    BLOCK = "block"  # refuse the text


# detect-secrets plugins left out (see the module docstring), by secret type.
_SKIPPED = {"Public IP (ipv4)"}
EMAIL = "email"
# Hand-written (see the module docstring): a local part, "@", and a dotted domain whose last
# label is alphabetic, so "a@b" or "x@localhost" do not match. Digits may follow the address
# (generated text runs on: "bob@example.com42" still hides an address).
_EMAIL = re.compile(
    r"(?<![\w.+%-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}(?![A-Za-z-])")
# A private key's plugin matches its BEGIN line; the finding runs to the END line (when
# there is one) so a redaction removes the key body too.
_KEY_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_MIN_GROUP = 8  # a capture group at least this long is the secret itself (else: whole match)


def _slug(secret_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", secret_type.lower()).strip("-")


@cache
def _patterns() -> tuple[tuple[str, re.Pattern[str]], ...]:
    """(kind, pattern) for every regex-based detect-secrets plugin, then e-mail."""
    out: list[tuple[str, re.Pattern[str]]] = []
    plugins: dict[str, type] = get_mapping_from_secret_type_to_class()
    for secret_type, plugin in sorted(plugins.items()):
        if not issubclass(plugin, RegexBasedDetector) or secret_type in _SKIPPED:
            continue
        # Each plugin sets ``denylist`` as a class attribute: a sequence of compiled patterns.
        patterns: Iterable[re.Pattern[str]] = plugin.denylist  # type: ignore[assignment]
        out.extend((_slug(secret_type), pattern) for pattern in patterns)
    out.append((EMAIL, _EMAIL))
    return tuple(out)


#: Every kind the detector reports (``[REDACTED:<kind>]`` uses these names).
KINDS: tuple[str, ...] = tuple(dict.fromkeys(kind for kind, _ in _patterns()))


@dataclass(frozen=True, order=True)
class Finding:
    start: int
    end: int
    kind: str


def _span(match: re.Match[str]) -> tuple[int, int]:
    groups = [i for i in range(1, (match.re.groups or 0) + 1)
              if match.group(i) and len(match.group(i)) >= _MIN_GROUP]
    if groups:
        best = max(groups, key=lambda i: len(match.group(i)))
        return match.span(best)
    return match.span()


def _raw(text: str) -> Iterator[Finding]:
    has_at = "@" in text
    for kind, pattern in _patterns():
        if kind == EMAIL and not has_at:
            continue
        for match in pattern.finditer(text):
            start, end = _span(match)
            if kind == "private-key":
                tail = _KEY_END.search(text, end)
                if tail:
                    end = tail.end()
            if end > start:
                yield Finding(start, end, kind)


def find(text: str) -> list[Finding]:
    """Findings in ``text``, sorted and not overlapping: overlapping ones merge into one
    span, named by a secret's kind rather than "email" (``user:password@host`` in a URL is
    a credential, not an address)."""
    out: list[Finding] = []
    for f in sorted(_raw(text), key=lambda f: (f.start, -f.end)):
        if out and f.start < out[-1].end:
            last = out[-1]
            kind = f.kind if last.kind == EMAIL else last.kind
            out[-1] = Finding(last.start, max(last.end, f.end), kind)
            continue
        out.append(f)
    return out


def redact(text: str, findings: list[Finding] | None = None) -> str:
    """``text`` with each finding replaced by ``[REDACTED:<kind>]``."""
    findings = find(text) if findings is None else findings
    parts, at = [], 0
    for f in findings:
        parts += [text[at:f.start], f"[REDACTED:{f.kind}]"]
        at = f.end
    parts.append(text[at:])
    return "".join(parts)


@dataclass(frozen=True)
class Screened:
    """A text or JSON value after its surface's policy: ``value`` is what may be stored or
    sent (redacted under ``redact``; as given under ``flag``, and under ``block`` where
    ``blocked`` says it must not go out); ``kinds`` what was found."""

    value: Any
    kinds: tuple[str, ...]
    mode: Mode

    @property
    def blocked(self) -> bool:
        return self.mode == Mode.BLOCK and bool(self.kinds)

    @property
    def changed(self) -> bool:
        return self.mode == Mode.REDACT and bool(self.kinds)


def _kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


def screen_text(text: str, mode: Mode | str) -> Screened:
    mode = Mode(mode)
    if mode == Mode.OFF:
        return Screened(text, (), mode)
    findings = find(text)
    kinds = tuple(sorted(set(_kinds(findings))))
    return Screened(redact(text, findings) if mode == Mode.REDACT and findings else text,
                    kinds, mode)


def _walk(value: Any, mode: Mode, found: set[str]) -> Any:
    """Screen every string in a JSON value (keys are names, not content: left alone)."""
    if isinstance(value, str):
        findings = find(value)
        found.update(_kinds(findings))
        return redact(value, findings) if mode == Mode.REDACT and findings else value
    if isinstance(value, dict):
        return {k: _walk(v, mode, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, mode, found) for v in value]
    return value


def screen_value(value: Any, mode: Mode | str) -> Screened:
    """:func:`screen_text` for a JSON value (a dataset record, a sample row)."""
    mode = Mode(mode)
    if mode == Mode.OFF:
        return Screened(value, (), mode)
    found: set[str] = set()
    out = _walk(value, mode, found)
    # Only redact changes the value; otherwise hand back the caller's own object.
    return Screened(out if mode == Mode.REDACT else value, tuple(sorted(found)), mode)


def kinds_of(text: str) -> tuple[str, ...]:
    """The kinds found in ``text`` (for flagging)."""
    return tuple(sorted({f.kind for f in find(text)}))
