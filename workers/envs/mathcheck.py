"""Symbolic answer checking: 1/2, 0.5 and \\frac{1}{2} are the same answer.

math-verify does the parsing (LaTeX and plain expressions) and the comparison; sympy is the
fallback for reference answers it cannot parse. Its timeouts use SIGALRM, which only works in
the main thread: elsewhere we run without them, so answers that could make sympy work for long
(very long text, power towers) are refused before parsing, and so is prose.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

MAX_ANSWER_CHARS = 200
_POWER_TOWER = re.compile(  # an exponent inside an exponent, or one with 4+ digits
    r"\^\s*\{[^{}]*\^|\^\s*\w+\s*\^|\*\*\s*\(?[\w.\s]*\*\*|(\^|\*\*)\s*\{?\s*\(?\s*\d{4,}")
_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{4,}")
_MATH_WORDS = {"sqrt", "infty", "frac", "dfrac", "tfrac", "text", "cdot", "left", "right",
               "mathrm", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh"}
_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is|:)?\s*[:=]?\s*(.+)", re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces walked by hand), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def extract_answer(completion: str) -> str:
    """The final answer: last \\boxed{}, else an `Answer: ...` line, else the last non-empty
    line. Surrounding `$` and a trailing period are dropped."""
    text = completion.strip()
    if not text:
        return ""
    boxed = extract_boxed(text)
    if boxed is not None:
        answer = boxed
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        found = [m.group(1) for line in lines if (m := _ANSWER_LINE.search(line))]
        answer = found[-1] if found else lines[-1]
    answer = answer.strip()
    answer = answer[:-1].strip() if answer.endswith(".") else answer
    return answer.strip("$").strip()


def _timeout() -> int | None:
    return 3 if threading.current_thread() is threading.main_thread() else None


def _plain_number(text: str) -> Fraction | None:
    """Exact value of an integer, decimal or a/b written plainly (fast path, no sympy)."""
    text = text.replace(" ", "").replace(",", "")
    try:
        if re.fullmatch(r"[-+]?\d+/\d+", text):
            num, den = text.split("/")
            return Fraction(int(num), int(den)) if int(den) else None
        if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _sympy_equal(pred: str, gold: str) -> bool:
    from sympy import nsimplify, simplify
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    def parse(text: str):
        text = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        text = text.replace("^", "**").replace("\\cdot", "*").replace("\\left", "")
        text = text.replace("\\right", "").replace("{", "(").replace("}", ")")
        return parse_expr(text, transformations=(*standard_transformations,
                                                 implicit_multiplication_application))

    try:
        return bool(simplify(nsimplify(parse(pred)) - nsimplify(parse(gold))) == 0)
    except Exception:  # noqa: BLE001 - unparseable means not equal
        return False


def equivalent(pred: str, gold: str) -> bool:
    """Whether two final answers are mathematically equal."""
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    if len(pred) > MAX_ANSWER_CHARS or _POWER_TOWER.search(pred):
        return False
    if any(w.lower() not in _MATH_WORDS for w in _WORD.findall(pred)):
        return False  # prose ("I don't know"), not a mathematical answer: skip the slow parse
    a, b = _plain_number(pred), _plain_number(gold)
    if a is not None and b is not None:
        return a == b
    from math_verify import parse, verify

    timeout = _timeout()
    try:
        parsed_gold = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        if parsed_gold:
            # A prediction math-verify cannot read is not an answer (no sympy second try:
            # it is slow on prose and would read "nope" as n*o*p*e).
            parsed_pred = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
            return bool(parsed_pred) and bool(
                verify(parsed_gold, parsed_pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - math-verify's own timeout and parse errors: fall back
        pass
    return _sympy_equal(pred, gold)


def perturbations(gold: str) -> list[str]:
    """Wrong answers a hair from a numeric `gold`: off by one, doubled, negated, an extra
    digit (catches substring and loose-tolerance checkers). Other answers get none."""
    value = _plain_number(gold)
    if value is None:  # symbolic or text answers: no perturbation is safely "wrong"
        return []
    out = {value + 1, value * 2 if value else Fraction(1), -value if value else Fraction(-1)}
    texts = [str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"
             for v in sorted(out)]
    digits = gold.replace(",", "")
    if re.fullmatch(r"-?\d+", digits):
        texts.append(digits + "1")
    return [t for t in texts if _plain_number(t) != value]


def is_parseable(gold: str) -> bool:
    """Whether the reference answer parses as mathematics (else only exact text matches)."""
    if _plain_number(gold) is not None:
        return True
    from math_verify import parse

    try:
        return bool(parse(f"\\boxed{{{gold}}}", parsing_timeout=_timeout()))
    except Exception:  # noqa: BLE001
        return False
