"""The one JSON-safety rule (workers/jsonsafe.py) every writer uses: what it keeps, what it
turns into null, and that its output always survives strict JSON."""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest

from workers.jsonsafe import is_finite_number, json_safe


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_become_null(value: float) -> None:
    assert json_safe(value) is None
    assert json_safe({"loss": value, "seq": [1.0, value]}) == {"loss": None, "seq": [1.0, None]}


def test_finite_values_pass_unchanged() -> None:
    value = {"a": 1, "b": 0.5, "c": True, "d": None, "e": "text", "f": [1, "x", False]}
    assert json_safe(value) == value


def test_keys_tuples_nuls_and_unknown_objects() -> None:
    cleaned = json_safe({1: (2, 3), "nul\x00": "a\x00b", "d": Decimal("1.5")})
    assert cleaned == {"1": [2, 3], "nul\ufffd": "a\ufffdb", "d": "1.5"}


def test_output_is_strict_json() -> None:
    messy = {"x": [math.nan, {"y": -math.inf, (1, 2): object()}], 3: "\x00"}
    text = json.dumps(json_safe(messy), allow_nan=False)
    assert json.loads(text)["x"][0] is None


@pytest.mark.parametrize(("value", "finite"), [
    (1, True), (0.25, True), (-3, True), (math.nan, False), (math.inf, False),
    (-math.inf, False), (True, False), (False, False), ("1", False), (None, False),
    (10**400, False), (10**300, True),
])
def test_is_finite_number(value: object, finite: bool) -> None:
    assert is_finite_number(value) is finite
