"""Adversarial perturbations of verified items: rename variables, change numbers, distract.

A perturbation returns new params (rebuilt by the topic or family, so the answer is re-derived by
construction) or a question with a distracting sentence; the variant then goes through the same
verification as any item.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from .math_topics import VARIABLES

_DISTRACTORS = (
    "A bakery sold {a} loaves of bread on {day}.",
    "Note that {a} students took this test last year and {b} of them passed.",
    "The room is {a} metres long and {b} metres wide.",
    "A train leaves the station at {h} o'clock with {a} passengers.",
    "Ignore the fact that {name} is {a} years old.",
    "The library opens at {h} o'clock and holds {a} books.",
)
_NAMES = ("Ada", "Bo", "Chen", "Dana", "Emil", "Farah")
_DAYS = ("Monday", "Tuesday", "Friday", "Sunday")
_NOT_NUMBERS = frozenset({"test_seed"})  # changing it draws new tests: still "renumber"


class NotApplicable(ValueError):
    """The perturbation cannot change this item (e.g. no variable to rename)."""


def rename(params: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    out = copy.deepcopy(params)
    if "var" in out:
        new = rng.choice([v for v in VARIABLES if v != out["var"]])
        detail = {"from": out["var"], "to": new}
        out["var"] = new
        return out, detail
    if "vars" in out:
        fresh = rng.sample([v for v in VARIABLES if v not in out["vars"]], 2)
        detail = {"from": list(out["vars"]), "to": fresh}
        out["vars"] = fresh
        return out, detail
    raise NotApplicable("no variable to rename")


def _nudge(value: int, rng: random.Random) -> int:
    step = max(3, abs(value) // 10)
    delta = 0
    while delta == 0:
        delta = rng.randint(-step, step)
    return value + delta


def renumber(params: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nudge about half of the integer parameters (at least one)."""
    out = copy.deepcopy(params)
    slots: list[tuple[Any, Any]] = []
    for key, value in out.items():
        if isinstance(value, bool) or key in _NOT_NUMBERS:
            continue
        if isinstance(value, int):
            slots.append((out, key))
        elif isinstance(value, list) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            slots.extend((value, i) for i in range(len(value)))
    if not slots:
        raise NotApplicable("no number to change")
    chosen = [s for s in slots if rng.random() < 0.5] or [rng.choice(slots)]
    for container, key in chosen:
        container[key] = _nudge(container[key], rng)
    if "test_seed" in out:
        out["test_seed"] = rng.getrandbits(32)
    changed = {k: [params[k], out[k]] for k in params if params[k] != out[k]}
    return out, {"changed": changed}


def distract(question: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    sentence = rng.choice(_DISTRACTORS).format(
        a=rng.randint(2, 99), b=rng.randint(2, 99), h=rng.randint(1, 12),
        name=rng.choice(_NAMES), day=rng.choice(_DAYS))
    first = rng.random() < 0.5
    text = f"{sentence} {question}" if first else f"{question}\n{sentence}"
    return text, {"sentence": sentence, "position": "before" if first else "after"}
