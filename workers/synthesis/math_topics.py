"""Symbolic math problems: sample parameters, then build question, answer and structured problem.

Each topic is `sample(rng, difficulty) -> params` (plain JSON: ints and names) and
`build(params) -> Built`. Answers are produced *by construction* (roots chosen before the
polynomial, a solution before the system, Fractions, trial division, Cramer's rule), while
`math_verify` re-derives them from the record's strings with sympy's solvers: the two paths
disagree when either is wrong. Adversarial variants rebuild from perturbed params, so "change the
numbers and re-derive the answer" is the same construction, checked the same way.
"""

from __future__ import annotations

import ast
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import sympy as sp

VARIABLES: tuple[str, ...] = ("x", "y", "z", "t", "u", "v", "w", "p", "q", "r", "s", "m")


class Degenerate(ValueError):
    """The parameters do not make a well-posed problem (zero divisor, singular system...)."""


@dataclass(frozen=True)
class Built:
    question: str
    answer: str
    problem: dict[str, Any]
    expressions: list[str] = field(default_factory=list)
    """Strings the question must state verbatim (checked by the logic stage)."""


def _frac(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _nz(rng: random.Random, lo: int, hi: int) -> int:
    while True:
        value = rng.randint(lo, hi)
        if value:
            return value


# -- arithmetic -------------------------------------------------------------------------------

_ARITH_OPS = {1: "+-", 2: "+-*", 3: "+-*/", 4: "+-*/^", 5: "+-*/^"}


def _eval_fraction(node: ast.AST) -> Fraction:
    """Exact evaluation of + - * / ** over integers: the generation path (no sympy)."""
    if isinstance(node, ast.Expression):
        return _eval_fraction(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_fraction(node.operand)
    if isinstance(node, ast.BinOp):
        left, right = _eval_fraction(node.left), _eval_fraction(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise Degenerate("division by zero")
            return left / right
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or not 0 <= right <= 4:
                raise Degenerate("exponents must be integers in 0..4")
            return left ** int(right)
    raise Degenerate(f"unsupported arithmetic node {type(node).__name__}")


def _arith_sample(rng: random.Random, d: int) -> dict[str, Any]:
    hi = (20, 50, 100, 100, 1000)[d - 1]
    n_ops = d + 1
    ops = [rng.choice(_ARITH_OPS[d]) for _ in range(n_ops)]
    numbers = [rng.randint(1, hi) if d < 4 else rng.randint(-hi // 2, hi) for _ in range(n_ops + 1)]
    for i, op in enumerate(ops):
        if op == "^":
            numbers[i + 1] = rng.randint(2, 3)
        elif op == "/" and numbers[i + 1] == 0:
            numbers[i + 1] = 1
    groups = [d >= 3 and rng.random() < 0.4 for _ in range(n_ops)]
    return {"numbers": numbers, "ops": ops, "groups": groups}


def _arith_build(p: dict[str, Any]) -> Built:
    numbers, ops, groups = p["numbers"], p["ops"], p["groups"]
    if len(numbers) != len(ops) + 1 or len(groups) != len(ops):
        raise Degenerate("numbers must be one more than ops, one group flag per op")

    def num(n: int) -> str:
        return f"({n})" if n < 0 else str(n)

    text = num(numbers[0])
    for op, n, group in zip(ops, numbers[1:], groups, strict=True):
        if op == "^":
            simple = _wrapped(text) or (" " not in text and "**" not in text)
            text = f"{text if simple else f'({text})'}**{num(n)}"
        else:
            text = f"{text} {op} {num(n)}"
            if group:
                text = f"({text})"
    value = _eval_fraction(ast.parse(text, mode="eval"))
    if abs(value.numerator) > 10**30 or value.denominator > 10**12:
        raise Degenerate("value too large to state")
    return Built(f"Compute the exact value of {text}. Give an integer or a reduced fraction.",
                 _frac(value), {"expression": text}, [text])


def _wrapped(text: str) -> bool:
    """Whether the whole text is one parenthesised group."""
    if not (text.startswith("(") and text.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(text) - 1:
            return False
    return True


# -- linear equations -------------------------------------------------------------------------


def _linear_sample(rng: random.Random, d: int) -> dict[str, Any]:
    hi = (9, 12, 15, 20, 40)[d - 1]
    q = 1 if d < 4 else rng.randint(2, 6)
    a = _nz(rng, 1, hi) if d == 1 else _nz(rng, -hi, hi)
    c = 0 if d < 3 else _nz(rng, -hi, hi)
    if c == a:
        c = a + 1
    return {"var": rng.choice(VARIABLES[:6]), "a": a, "b": rng.randint(-hi, hi), "c": c,
            "p": rng.randint(-hi, hi), "q": q, "paren": d == 5}


def _linear_build(p: dict[str, Any]) -> Built:
    a, b, c, q = p["a"], p["b"], p["c"], p["q"]
    if a == c:
        raise Degenerate("the unknown cancels (a == c)")
    if q == 0:
        raise Degenerate("zero denominator")
    x = sp.Symbol(p["var"])
    s = Fraction(p["p"], q)
    e = (a - c) * s + b  # the right-hand constant that makes s the solution
    lhs = sp.Mul(a, x + b, evaluate=False) if p.get("paren") else a * x + b
    if p.get("paren"):
        e = (a - c) * s + a * b
    rhs = c * x + sp.Rational(e.numerator, e.denominator)
    lhs_s, rhs_s = str(lhs), str(rhs)
    return Built(f"Solve for {x}: {lhs_s} = {rhs_s}.", _frac(s),
                 {"lhs": lhs_s, "rhs": rhs_s, "variable": str(x)}, [lhs_s, rhs_s])


# -- quadratic equations ----------------------------------------------------------------------


def _quadratic_sample(rng: random.Random, d: int) -> dict[str, Any]:
    var = rng.choice(VARIABLES[:6])
    if d <= 3:  # roots first: a*(d1*x - n1)*(d2*x - n2)
        hi = (6, 10, 8)[d - 1]
        lead = 1 if d == 1 else _nz(rng, -3, 3)
        d1 = 1 if d < 3 else rng.randint(1, 4)
        d2 = 1 if d < 3 else rng.randint(1, 3)
        n1, n2 = rng.randint(-hi, hi), rng.randint(-hi, hi)
        a, b, c = lead * d1 * d2, -lead * (d1 * n2 + d2 * n1), lead * n1 * n2
    else:
        while True:  # about one draw in three fits either case
            a, b, c = _nz(rng, -5, 5), rng.randint(-12, 12), rng.randint(-15, 15)
            disc = b * b - 4 * a * c
            if (d == 4 and disc > 0 and math.isqrt(disc) ** 2 != disc) or (d == 5 and disc < 0):
                break
    k, m = (rng.randint(-6, 6), rng.randint(-9, 9)) if d >= 3 else (0, 0)
    return {"var": var, "a": a, "b": b, "c": c, "k": k, "m": m, "complex": d == 5}


def _quadratic_roots(a: int, b: int, c: int) -> list[sp.Expr]:
    """The quadratic formula (the generation path; verification uses sympy.roots)."""
    disc = b * b - 4 * a * c
    if disc == 0:
        return [sp.Rational(-b, 2 * a)]
    root = math.isqrt(disc) if disc > 0 else -1
    if disc > 0 and root * root == disc:
        return sorted({sp.Rational(-b - root, 2 * a), sp.Rational(-b + root, 2 * a)})
    sq = sp.sqrt(sp.Integer(disc))
    pair = [sp.Rational(-b, 2 * a) - sq / (2 * abs(a)), sp.Rational(-b, 2 * a) + sq / (2 * abs(a))]
    return pair


def _quadratic_build(p: dict[str, Any]) -> Built:
    a, b, c, k, m = p["a"], p["b"], p["c"], p["k"], p["m"]
    if a == 0:
        raise Degenerate("not a quadratic (a == 0)")
    x = sp.Symbol(p["var"])
    lhs = a * x**2 + (b + k) * x + (c + m)
    rhs = k * x + m
    lhs_s, rhs_s = str(lhs), str(rhs)
    roots = _quadratic_roots(a, b, c)
    if any(r.has(sp.I) for r in roots) and not p.get("complex"):
        raise Degenerate("complex roots in a real-roots problem")
    answer = "[" + ", ".join(str(r) for r in roots) + "]"
    kind = "all complex solutions" if p.get("complex") else "all real solutions"
    return Built(f"Solve for {x}: {lhs_s} = {rhs_s}. Give {kind} as a list.", answer,
                 {"lhs": lhs_s, "rhs": rhs_s, "variable": str(x)}, [lhs_s, rhs_s])


# -- 2x2 linear systems -----------------------------------------------------------------------


def _system_sample(rng: random.Random, d: int) -> dict[str, Any]:
    hi = (5, 9, 9, 12, 20)[d - 1]
    names = rng.choice([("x", "y"), ("x", "y"), ("u", "v"), ("p", "q"), ("s", "t")])
    while True:
        a1, b1, a2, b2 = (_nz(rng, -hi, hi) for _ in range(4))
        if a1 * b2 - a2 * b1:
            break
    if d <= 2:
        x0, y0 = rng.randint(-hi, hi), rng.randint(-hi, hi)
        c1, c2 = a1 * x0 + b1 * y0, a2 * x0 + b2 * y0
    else:
        c1, c2 = rng.randint(-3 * hi, 3 * hi), rng.randint(-3 * hi, 3 * hi)
    return {"vars": list(names), "a1": a1, "b1": b1, "c1": c1, "a2": a2, "b2": b2, "c2": c2}


def _system_build(p: dict[str, Any]) -> Built:
    a1, b1, c1, a2, b2, c2 = (p[k] for k in ("a1", "b1", "c1", "a2", "b2", "c2"))
    names = p["vars"]
    if len(names) != 2 or names[0] == names[1]:
        raise Degenerate("a system needs two distinct variables")
    det = a1 * b2 - a2 * b1
    if det == 0:
        raise Degenerate("singular system")
    x0, y0 = Fraction(c1 * b2 - c2 * b1, det), Fraction(a1 * c2 - a2 * c1, det)  # Cramer
    x, y = sp.Symbol(names[0]), sp.Symbol(names[1])
    eqs = [[str(a1 * x + b1 * y), str(c1)], [str(a2 * x + b2 * y), str(c2)]]
    stated = [f"{lhs} = {rhs}" for lhs, rhs in eqs]
    return Built(
        f"Solve the system for {x} and {y}: {stated[0]} and {stated[1]}. Give ({x}, {y}).",
        f"({_frac(x0)}, {_frac(y0)})", {"equations": eqs, "variables": [str(x), str(y)]}, stated)


# -- calculus ---------------------------------------------------------------------------------

_FUNCS = {"sin": sp.sin, "cos": sp.cos, "exp": sp.exp}


def _calc_sample(rng: random.Random, d: int) -> dict[str, Any]:
    form = {1: ["poly"], 2: ["poly_fn"], 3: ["product"], 4: ["chain", "log"],
            5: ["quotient", "exp_trig"]}[d]
    return {"var": rng.choice(VARIABLES[:6]), "form": rng.choice(form),
            "fn": rng.choice(sorted(_FUNCS)), "c": [rng.randint(-9, 9) for _ in range(4)],
            "k": _nz(rng, -4, 4) if d > 1 else 1}


def _calc_function(p: dict[str, Any]) -> sp.Expr:
    x = sp.Symbol(p["var"])
    c0, c1, c2, c3 = p["c"]
    k, fn, form = p["k"], _FUNCS.get(p["fn"]), p["form"]
    if fn is None:
        raise Degenerate(f"unknown function {p['fn']!r}")
    poly = c3 * x**3 + c2 * x**2 + c1 * x + c0
    exprs = {
        "poly": lambda: poly,
        "poly_fn": lambda: c2 * x**2 + c1 * x + _nz_or(c0) * fn(k * x),
        "product": lambda: (_nz_or(c2) * x**2 + c0) * fn(k * x),
        "chain": lambda: fn(_nz_or(c2) * x**2 + c1 * x + c0),
        "log": lambda: sp.log(x**2 + abs(c0) + 1),
        "quotient": lambda: (_nz_or(c1) * x + c0) / (x**2 + abs(k)),
        "exp_trig": lambda: sp.exp(k * x) * sp.sin(_nz_or(c1) * x),
    }
    if form not in exprs:
        raise Degenerate(f"unknown form {form!r}")
    f = exprs[form]()
    if not f.has(x):
        raise Degenerate("the function does not depend on the variable")
    return f


def _nz_or(value: int) -> int:
    return value if value else 1


def _derivative_build(p: dict[str, Any]) -> Built:
    x = sp.Symbol(p["var"])
    f = _calc_function(p)
    f_s = str(f)
    return Built(f"Differentiate f({x}) = {f_s} with respect to {x}.", str(sp.diff(f, x)),
                 {"function": f_s, "variable": str(x)}, [f_s])


def _integral_sample(rng: random.Random, d: int) -> dict[str, Any]:
    if d <= 2:
        lo = rng.randint(-3, 2)
        return {"var": rng.choice(VARIABLES[:6]), "form": "definite",
                "c": [rng.randint(-6, 6) for _ in range(d + 2)], "lo": lo,
                "hi": lo + rng.randint(1, 4)}
    return _calc_sample(rng, d - 1)


def _integral_build(p: dict[str, Any]) -> Built:
    x = sp.Symbol(p["var"])
    if p["form"] == "definite":
        coeffs = p["c"]  # coefficient of x**i
        if not any(coeffs):
            raise Degenerate("zero integrand")
        integrand = sum((c * x**i for i, c in enumerate(coeffs)), sp.Integer(0))
        lo, hi = p["lo"], p["hi"]

        def prim(t: int) -> Fraction:  # power rule on Fractions: the generation path
            return sum((Fraction(c, i + 1) * Fraction(t) ** (i + 1) for i, c in enumerate(coeffs)),
                       Fraction(0))

        f_s = str(integrand)
        return Built(f"Compute the definite integral of {f_s} with respect to {x} from {lo} to "
                     f"{hi}.",
                     _frac(prim(hi) - prim(lo)),
                     {"integrand": f_s, "variable": str(x), "lower": lo, "upper": hi}, [f_s])
    big_f = _calc_function(p)  # the antiderivative is chosen first
    integrand = sp.expand(sp.diff(big_f, x)) if p["form"] == "poly" else sp.diff(big_f, x)
    f_s = str(integrand)
    return Built(f"Find an antiderivative of {f_s} with respect to {x}.", str(big_f),
                 {"integrand": f_s, "variable": str(x), "lower": None, "upper": None}, [f_s])


# -- number theory ----------------------------------------------------------------------------


def _euclid(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return abs(a)


def _gcd_sample(rng: random.Random, d: int) -> dict[str, Any]:
    g = rng.randint(1, (12, 30, 20, 12, 10**4)[d - 1])
    count = 3 if d == 3 else (rng.randint(2, 3) if d == 4 else 2)
    top = (9, 30, 40, 20, 10**5)[d - 1]
    return {"op": "lcm" if d == 4 else "gcd",
            "numbers": [g * rng.randint(1, top) for _ in range(count)]}


def _gcd_build(p: dict[str, Any]) -> Built:
    numbers, op = p["numbers"], p["op"]
    if len(numbers) < 2 or any(not isinstance(n, int) or n <= 0 for n in numbers):
        raise Degenerate("need two or more positive integers")
    if op not in ("gcd", "lcm"):
        raise Degenerate(f"unknown op {op!r}")
    acc = numbers[0]
    for n in numbers[1:]:
        acc = _euclid(acc, n) if op == "gcd" else acc * n // _euclid(acc, n)
    listed = ", ".join(str(n) for n in numbers)
    name = "greatest common divisor" if op == "gcd" else "least common multiple"
    return Built(f"Find the {name} of {listed}.", str(acc), {"op": op, "numbers": numbers},
                 [str(n) for n in numbers])


def _modular_sample(rng: random.Random, d: int) -> dict[str, Any]:
    op = ("mod", "mulmod", "powmod", "inverse", "congruence")[d - 1]
    m = rng.randint(5, (20, 50, 100, 200, 500)[d - 1])
    a = rng.randint(2, (500, 300, 50, m - 1, m - 1)[d - 1])
    b = rng.randint(2, (2, 300, 60, 2, m - 1)[d - 1])
    if op in ("inverse", "congruence"):
        while _euclid(a, m) != 1:
            a = rng.randint(2, max(2, m - 1))
    return {"op": op, "a": a, "b": b, "m": m}


def _modular_build(p: dict[str, Any]) -> Built:
    op, a, b, m = p["op"], p["a"], p["b"], p["m"]
    if m < 2 or a < 0 or b < 0:
        raise Degenerate("modulus must be >= 2 and operands non-negative")
    if op == "mod":
        return Built(f"Compute {a} mod {m}.", str(a % m), p, [str(a), str(m)])
    if op == "mulmod":
        return Built(f"Compute ({a} * {b}) mod {m}.", str(a * b % m), p, [str(a), str(b), str(m)])
    if op == "powmod":
        if b > 1000:
            raise Degenerate("exponent too large")
        return Built(f"Compute {a}**{b} mod {m}.", str(pow(a, b, m)), p, [f"{a}**{b}", str(m)])
    if _euclid(a, m) != 1:
        raise Degenerate(f"{a} has no inverse modulo {m}")
    inverse = pow(a, -1, m)
    if op == "inverse":
        return Built(f"Find the inverse of {a} modulo {m}, as an integer in [0, {m}).",
                     str(inverse), p, [str(a), str(m)])
    if op == "congruence":
        return Built(f"Find the smallest non-negative integer x with {a}*x = {b} (mod {m}).",
                     str(inverse * b % m), p, [f"{a}*x = {b}", str(m)])
    raise Degenerate(f"unknown op {op!r}")


def _trial_factor(n: int) -> dict[int, int]:
    factors: dict[int, int] = {}
    f = 2
    while f * f <= n:
        while n % f == 0:
            factors[f] = factors.get(f, 0) + 1
            n //= f
        f += 1 if f == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def _primes_upto(n: int) -> list[int]:
    sieve = bytearray([1]) * (n + 1)
    sieve[: min(2, n + 1)] = b"\x00" * min(2, n + 1)
    for i in range(2, math.isqrt(n) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n + 1, i)))
    return [i for i in range(n + 1) if sieve[i]]


def _primes_sample(rng: random.Random, d: int) -> dict[str, Any]:
    if d == 5:
        small = _primes_upto(300)
        n = 1
        for _ in range(rng.randint(2, 4)):
            n *= rng.choice(small)
        return {"op": "largest_factor", "n": n * rng.choice(_primes_upto(5000)[60:])}
    op = ("isprime", "nth", "count", "factor")[d - 1]
    n = {"isprime": rng.randint(2, 200), "nth": rng.randint(1, 120),
         "count": rng.randint(10, 3000), "factor": rng.randint(20, 10**5)}[op]
    return {"op": op, "n": n}


def _factor_text(factors: dict[int, int]) -> str:
    return "*".join(f"{pr}**{e}" if e > 1 else str(pr) for pr, e in sorted(factors.items()))


def _primes_build(p: dict[str, Any]) -> Built:
    op, n = p["op"], p["n"]
    if not isinstance(n, int) or n < 1 or n > 10**12:
        raise Degenerate("n must be an integer in 1..10**12")
    if op == "isprime":
        if n < 2:
            raise Degenerate("primality of n < 2 is a trick question")
        prime = _trial_factor(n) == {n: 1}
        return Built(f"Is {n} a prime number? Answer yes or no.", "yes" if prime else "no", p,
                     [str(n)])
    if op == "nth":
        if n > 5000:
            raise Degenerate("n too large")
        bound = max(15, int(n * (math.log(n + 1) + math.log(math.log(n + 3)) + 2)))
        return Built(f"What is the {n}-th prime number (2 is the 1st)?",
                     str(_primes_upto(bound)[n - 1]), p, [str(n)])
    if op == "count":
        if n > 10**6:
            raise Degenerate("n too large")
        return Built(f"How many prime numbers are less than or equal to {n}?",
                     str(len(_primes_upto(n))), p, [str(n)])
    if n < 2:
        raise Degenerate("1 has no prime factors")
    factors = _trial_factor(n)
    if op == "factor":
        return Built(f"Write the prime factorization of {n} as a product of prime powers "
                     "(e.g. 2**3*5).", _factor_text(factors), p, [str(n)])
    if op == "largest_factor":
        return Built(f"What is the largest prime factor of {n}?", str(max(factors)), p, [str(n)])
    raise Degenerate(f"unknown op {op!r}")


@dataclass(frozen=True)
class Topic:
    sample: Callable[[random.Random, int], dict[str, Any]]
    build: Callable[[dict[str, Any]], Built]


TOPICS: dict[str, Topic] = {
    "arithmetic": Topic(_arith_sample, _arith_build),
    "linear": Topic(_linear_sample, _linear_build),
    "quadratic": Topic(_quadratic_sample, _quadratic_build),
    "system": Topic(_system_sample, _system_build),
    "derivative": Topic(_calc_sample, _derivative_build),
    "integral": Topic(_integral_sample, _integral_build),
    "gcd": Topic(_gcd_sample, _gcd_build),
    "modular": Topic(_modular_sample, _modular_build),
    "primes": Topic(_primes_sample, _primes_build),
}
