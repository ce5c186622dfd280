"""Dataset versions pinned to a training run: SFT pairs and preference pairs.

A pinned dataset plays one role, told by the shape of its records (the first one decides, every
other one must agree):

- **preference**: ``prompt``, ``chosen`` and ``rejected`` strings (the usual DPO layout);
- **sft**: ``prompt`` + ``completion``, or ``prompt`` + ``answer`` / ``reference``, or
  ``question`` + ``answer`` (the records synthesis runs produce); or any record at all when
  ``sft.prompt_template`` / ``sft.completion_template`` say how to build the two texts, e.g.
  ``"{problem[expression]}="``.

Templates are ``str.format`` strings restricted to field names and ``[key]`` lookups: attribute
access (``{x.__class__}``) is refused, so a template can only read the record's own JSON.
Only the standard library is imported: the control plane uses this to check a launch.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["sft", "preference"]

_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^\[\]]+\])*$")
SFT_SHAPES = (("prompt", "completion"), ("prompt", "answer"), ("prompt", "reference"),
              ("question", "answer"))
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


class PinnedDataError(ValueError):
    """A pinned dataset that cannot play a role in this run; the message names what to fix."""


def template_fields(template: str) -> list[str]:
    """The field names a template reads; raises ValueError naming a forbidden one."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"template {template!r} is not a format string: {exc}") from exc
    names = []
    for _, name, spec, _ in parts:
        if name is None:
            continue
        if not name or not _FIELD.match(name):
            raise ValueError(f"template field {{{name}}} must be a record field with optional "
                             "[key] lookups, e.g. {question} or {problem[expression]}")
        if spec and "{" in spec:
            raise ValueError(f"template field {{{name}}} may not nest fields in its format spec")
        names.append(name)
    if not names:
        raise ValueError(f"template {template!r} reads no record field")
    return names


def render(template: str, record: Mapping[str, Any]) -> str:
    template_fields(template)
    return template.format_map(record)


def _strings(record: Mapping[str, Any], names: Iterable[str]) -> bool:
    return all(isinstance(record.get(n), str) and record.get(n) != "" for n in names)


def record_role(record: Any, *, templated: bool = False) -> Role | None:
    """The role a record's shape fits, or None."""
    if not isinstance(record, Mapping):
        return None
    if _strings(record, PREFERENCE_FIELDS):
        return "preference"
    if templated or any(_strings(record, shape) for shape in SFT_SHAPES):
        return "sft"
    return None


def shape_hint() -> str:
    shapes = " | ".join("+".join(s) for s in SFT_SHAPES)
    return (f"an SFT dataset has {shapes} (or set sft.prompt_template and "
            "sft.completion_template); a preference dataset has prompt+chosen+rejected")


def check_roles(roles: Mapping[str, Role], *, sft_steps: int, sft_environment: bool,
                preference_steps: int) -> None:
    """Refuse pinned datasets a run would silently ignore, and a phase with nothing to learn.
    ``roles`` maps each pinned dataset's label to its role."""
    sft = [label for label, role in roles.items() if role == "sft"]
    preference = [label for label, role in roles.items() if role == "preference"]
    if sft and sft_steps == 0:
        raise PinnedDataError(f"the run pins SFT dataset(s) {', '.join(sft)} but sft.steps "
                              "is 0: set sft.steps, or do not pin them")
    if preference and preference_steps == 0:
        raise PinnedDataError(f"the run pins preference dataset(s) {', '.join(preference)} but "
                              "preference.steps is 0: set preference.steps, or do not pin them")
    if preference_steps and not preference:
        raise PinnedDataError("preference.steps is set but the run pins no preference dataset "
                              "(records with prompt, chosen and rejected)")
    if sft_steps and not sft_environment and not sft:
        raise PinnedDataError("sft.environment is false and the run pins no SFT dataset: SFT "
                              "would have nothing to imitate")


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass
class PinnedData:
    """What the run's pinned datasets give the engine, with where each part came from."""

    sft: list[tuple[str, str]] = field(default_factory=list)  # (prompt, completion)
    preference: list[PreferencePair] = field(default_factory=list)
    sources: dict[str, tuple[Role, int]] = field(default_factory=dict)  # label -> role, count

    def corpus(self) -> list[str]:
        """Texts a trained tokenizer must cover."""
        texts = [p + c for p, c in self.sft]
        texts += [p.prompt + p.chosen for p in self.preference]
        texts += [p.prompt + p.rejected for p in self.preference]
        return texts


def sft_pair(record: Mapping[str, Any], prompt_template: str | None,
             completion_template: str | None) -> tuple[str, str]:
    if prompt_template is not None:
        prompt = render(prompt_template, record)
    else:
        prompt = record["prompt"] if _strings(record, ("prompt",)) else record["question"]
    if completion_template is not None:
        completion = render(completion_template, record)
    else:
        keys = ("completion", "answer", "reference")
        completion = next(record[k] for k in keys if _strings(record, (k,)))
    return str(prompt), str(completion)


def load_pinned(datasets: Mapping[str, Iterable[Any]], *, prompt_template: str | None = None,
                completion_template: str | None = None) -> PinnedData:
    """Every pinned dataset's records as SFT or preference pairs.

    ``datasets`` maps a label (``slug@vN``) to its records. The first record fixes the role;
    a later record of another shape is an error naming the dataset and the record.
    """
    templated = prompt_template is not None and completion_template is not None
    data = PinnedData()
    for label, records in datasets.items():
        role: Role | None = None
        count = 0
        for index, record in enumerate(records):
            got = record_role(record, templated=templated)
            if got is None or (role is not None and got != role):
                wanted = f"a {role} record like the first" if role else shape_hint()
                seen = sorted(record) if isinstance(record, Mapping) else repr(record)[:80]
                raise PinnedDataError(f"dataset {label}, record {index}: {wanted}; got {seen}")
            role = got
            try:
                if role == "preference":
                    data.preference.append(PreferencePair(
                        record["prompt"], record["chosen"], record["rejected"]))
                else:
                    data.sft.append(sft_pair(record, prompt_template, completion_template))
            except (KeyError, IndexError, TypeError) as exc:
                raise PinnedDataError(f"dataset {label}, record {index}: the SFT template "
                                      f"reads a field it does not have ({exc})") from exc
            count += 1
        if role is None:
            raise PinnedDataError(f"dataset {label} holds no records")
        data.sources[label] = (role, count)
    return data


__all__ = ["PinnedData", "PinnedDataError", "PreferencePair", "check_roles", "load_pinned",
           "record_role",
           "render", "shape_hint", "sft_pair", "template_fields"]
