"""Two verification stages of a math item, from its record strings alone.

Stage 1 (syntax): every expression is well formed — a whitelist walk of its Python syntax tree
(names, calls, operators and sizes; model-written strings are untrusted and sympy's parser
evaluates), then sympy parses it. Stage 2 (logic): the answer is re-derived with sympy's solvers
(Poly coefficients, `roots`, LU solve, `diff`, `Poly.integrate`, `igcd`, `mod_inverse`,
`factorint`...) independently of how the generator built it, calculus answers are also checked
numerically (mpmath finite differences), and the question must state the problem's expressions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import mpmath
import sympy as sp
from sympy.parsing.sympy_parser import parse_expr
from sympy.polys.polyroots import roots_quadratic

from .math_topics import VARIABLES

FUNCTIONS = frozenset({"sin", "cos", "tan", "exp", "log", "sqrt", "Abs"})
CONSTANTS = frozenset({"pi", "E", "I"})
_MAX_LEN = 400
_MAX_INT = 10**40
_MAX_EXPONENT = 1000
_POINTS = (0.37, 1.13, -0.71)


class Reject(Exception):
    """A failed check: `code` is the stage-qualified reason, `detail` says what was wrong."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


@dataclass
class Check:
    stage: str
    ok: bool
    check: str
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "ok": self.ok, "check": self.check, "detail": self.detail}


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div,
                  ast.Pow, ast.USub, ast.UAdd, ast.Call, ast.Name, ast.Load, ast.Constant,
                  ast.List, ast.Tuple)


def _walk_ok(text: str, names: frozenset[str]) -> ast.Expression:
    if len(text) > _MAX_LEN:
        raise Reject("syntax:too_long", f"expression longer than {_MAX_LEN} characters")
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise Reject("syntax:unparseable", f"{text!r}: {exc.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise Reject("syntax:forbidden", f"{type(node).__name__} is not allowed in {text!r}")
        if isinstance(node, ast.Name) and node.id not in names | FUNCTIONS | CONSTANTS:
            raise Reject("syntax:unknown_name", f"unknown name {node.id!r} in {text!r}")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS
            or node.keywords or len(node.args) != 1
        ):
            raise Reject("syntax:forbidden", f"only {sorted(FUNCTIONS)} of one argument may be "
                         f"called in {text!r}")
        if isinstance(node, ast.Constant) and (
            not isinstance(node.value, int | float) or isinstance(node.value, bool)
            or abs(node.value) > _MAX_INT
        ):
            raise Reject("syntax:bad_constant", f"constant {node.value!r} in {text!r}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exp = node.right
            if isinstance(exp, ast.UnaryOp):
                exp = exp.operand
            if not isinstance(exp, ast.Constant | ast.Name) or (
                # A non-number constant is refused when the walk reaches it (bad_constant).
                isinstance(exp, ast.Constant) and isinstance(exp.value, int | float)
                and abs(exp.value) > _MAX_EXPONENT
            ):
                raise Reject("syntax:bad_exponent",
                             f"exponents must be small constants in {text!r}")
    return tree


def parse(text: Any, names: frozenset[str] = frozenset()) -> sp.Basic:
    """A sympy object from an untrusted string, after the whitelist walk."""
    if not isinstance(text, str) or not text.strip():
        raise Reject("syntax:empty", f"expected a non-empty expression string, got {text!r}")
    tree = _walk_ok(text, names)
    try:
        return _to_sympy(tree.body)
    except (TypeError, ValueError, ZeroDivisionError, ArithmeticError) as exc:
        raise Reject("syntax:unparseable", f"{text!r}: {type(exc).__name__}: {exc}") from None


_SYMPY_FUNCS = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "exp": sp.exp, "log": sp.log,
                "sqrt": sp.sqrt, "Abs": sp.Abs}
_SYMPY_CONSTANTS = {"pi": sp.pi, "E": sp.E, "I": sp.I}


def _to_sympy(node: ast.AST) -> Any:
    """The whitelisted tree as sympy objects: integers stay exact (1/3 is Rational(1, 3)), as
    sympy's own parser makes them, without its tokenizer and `eval` (several times faster)."""
    if isinstance(node, ast.Constant):
        return sp.Integer(node.value) if isinstance(node.value, int) else sp.Float(node.value)
    if isinstance(node, ast.Name):
        return _SYMPY_CONSTANTS.get(node.id) or sp.Symbol(node.id)
    if isinstance(node, ast.UnaryOp):
        value = _to_sympy(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _to_sympy(node.left), _to_sympy(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ZeroDivisionError("division by zero")
            return left / right
        return left**right
    if isinstance(node, ast.Call):
        return _SYMPY_FUNCS[node.func.id](_to_sympy(node.args[0]))  # type: ignore[attr-defined]
    if isinstance(node, ast.List | ast.Tuple):
        items = [_to_sympy(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    raise ValueError(f"unsupported node {type(node).__name__}")


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > _MAX_INT:
        raise Reject("syntax:bad_field", f"{name} must be an integer, got {value!r}")
    return value


def _var(value: Any) -> str:
    if not isinstance(value, str) or value not in VARIABLES:
        raise Reject("syntax:bad_field", f"variable must be one of {', '.join(VARIABLES)}")
    return value


def _same(a: Any, b: Any) -> bool:
    """Symbolic equality: structural, then a numeric screen (cheap rejection of unequal values at
    a few points), then the expanded difference, then simplify (rarely reached)."""
    if a == b:
        return True
    if not isinstance(a, sp.Basic) or not isinstance(b, sp.Basic):
        return False
    try:
        diff = sp.expand(a - b)
        if diff == 0:
            return True
        symbols = sorted(diff.free_symbols, key=str)
        for point in _POINTS[:2]:
            value = complex(diff.evalf(20, subs=dict.fromkeys(symbols, point)))
            if abs(value) > 1e-12:
                return False
        return bool(sp.simplify(diff) == 0)
    except (TypeError, ValueError):
        return False


_MP_FUNCS = {"sin": mpmath.sin, "cos": mpmath.cos, "tan": mpmath.tan, "exp": mpmath.exp,
             "log": mpmath.log, "sqrt": mpmath.sqrt, "Abs": abs}
_MP_CONSTANTS = {"pi": mpmath.pi, "E": mpmath.e, "I": mpmath.mpc(0, 1)}


def _mp_eval(node: ast.AST, env: dict[str, Any]) -> Any:
    """Evaluate a whitelisted tree with mpmath: the numeric path shares nothing with sympy."""
    if isinstance(node, ast.Expression):
        return _mp_eval(node.body, env)
    if isinstance(node, ast.Constant):
        return mpmath.mpf(node.value)
    if isinstance(node, ast.Name):
        return env[node.id] if node.id in env else _MP_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp):
        value = _mp_eval(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _mp_eval(node.left, env), _mp_eval(node.right, env)
        ops = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
               ast.Mult: lambda: left * right, ast.Div: lambda: left / right,
               ast.Pow: lambda: left**right}
        return ops[type(node.op)]()
    if isinstance(node, ast.Call):
        return _MP_FUNCS[node.func.id](_mp_eval(node.args[0], env))  # type: ignore[attr-defined]
    raise ValueError(f"cannot evaluate {type(node).__name__} numerically")


def _numeric_derivative_match(f: ast.AST, g: ast.AST, var: str) -> bool:
    """d/dvar f == g at a few points (relative 1e-8), by mpmath's numerical differentiation."""
    with mpmath.workdps(30):
        for point in _POINTS:
            a = complex(mpmath.diff(lambda t: _mp_eval(f, {var: t}), mpmath.mpf(point)))
            b = complex(_mp_eval(g, {var: mpmath.mpf(point)}))
            if abs(a - b) > 1e-8 * max(1.0, abs(a), abs(b)):
                return False
    return True


def _stated(topic: str, problem: dict[str, Any]) -> list[str]:
    if topic == "arithmetic":
        return [problem["expression"]]
    if topic in ("linear", "quadratic"):
        return [problem["lhs"], problem["rhs"]]
    if topic == "system":
        return [f"{lhs} = {rhs}" for lhs, rhs in problem["equations"]]
    if topic == "derivative":
        return [problem["function"]]
    if topic == "integral":
        return [problem["integrand"]]
    if topic == "gcd":
        return [str(n) for n in problem["numbers"]]
    if topic == "modular":
        return [str(problem["a"]), str(problem["m"])]
    return [str(problem["n"])]


def _squash(text: str) -> str:
    return "".join(text.split())


class _Parsed(dict):
    """Parsed objects of stage 1, handed to stage 2."""


def syntax(topic: str, problem: dict[str, Any], answer: Any) -> _Parsed:
    """Stage 1: the problem's fields have the right types and every expression parses."""
    if not isinstance(problem, dict):
        raise Reject("syntax:bad_field", "problem must be an object")
    if not isinstance(answer, str) or not answer.strip():
        raise Reject("syntax:empty", "answer must be a non-empty string")
    out = _Parsed()
    try:
        if topic == "arithmetic":
            out["expr"] = parse(problem["expression"])
            out["answer"] = parse(answer)
        elif topic in ("linear", "quadratic"):
            v = _var(problem["variable"])
            out["var"] = sp.Symbol(v)
            out["eq"] = parse(problem["lhs"], frozenset({v})) - parse(problem["rhs"],
                                                                      frozenset({v}))
            out["answer"] = parse(answer)
        elif topic == "system":
            names = problem["variables"]
            if not isinstance(names, list) or len(names) != 2 or names[0] == names[1]:
                raise Reject("syntax:bad_field", "variables must be two distinct names")
            scope = frozenset(_var(n) for n in names)
            eqs = problem["equations"]
            if not isinstance(eqs, list) or len(eqs) != 2 or any(len(e) != 2 for e in eqs):
                raise Reject("syntax:bad_field", "equations must be two [lhs, rhs] pairs")
            out["vars"] = [sp.Symbol(n) for n in names]
            out["eqs"] = [parse(lhs, scope) - parse(rhs, scope) for lhs, rhs in eqs]
            out["answer"] = parse(answer)
        elif topic in ("derivative", "integral"):
            v = _var(problem["variable"])
            out["var"] = sp.Symbol(v)
            key = "function" if topic == "derivative" else "integrand"
            out["f"] = parse(problem[key], frozenset({v}))
            out["answer"] = parse(answer, frozenset({v}))
            out["f_tree"] = _walk_ok(problem[key], frozenset({v}))
            out["answer_tree"] = _walk_ok(answer, frozenset({v}))
            if topic == "integral" and problem.get("lower") is not None:
                out["bounds"] = (_int(problem["lower"], "lower"), _int(problem["upper"], "upper"))
        elif topic == "gcd":
            numbers = problem["numbers"]
            if not isinstance(numbers, list) or len(numbers) < 2:
                raise Reject("syntax:bad_field", "numbers must list two or more integers")
            out["numbers"] = [_int(n, "numbers[]") for n in numbers]
            out["answer"] = parse(answer)
        elif topic == "modular":
            out.update({k: _int(problem[k], k) for k in ("a", "b", "m")})
            out["answer"] = parse(answer)
        elif topic == "primes":
            out["n"] = _int(problem["n"], "n")
            if problem["op"] == "isprime":
                if answer.strip().lower() not in ("yes", "no"):
                    raise Reject("syntax:bad_answer", "answer yes or no")
                out["answer"] = answer.strip().lower()
            elif problem["op"] == "factor":
                _walk_ok(answer, frozenset())
                try:
                    out["answer"] = parse_expr(answer.replace("^", "**"), evaluate=False)
                except Exception as exc:  # sympy raises many types for malformed input
                    raise Reject("syntax:unparseable", f"{answer!r}: {exc}") from None
            else:
                out["answer"] = parse(answer)
        else:
            raise Reject("syntax:bad_field", f"unknown topic {topic!r}")
    except KeyError as exc:
        raise Reject("syntax:bad_field", f"problem lacks field {exc}") from None
    return out


def _expect_rational(value: sp.Basic, what: str) -> sp.Rational:
    if not isinstance(value, sp.Rational):
        raise Reject("logic:not_a_number", f"{what} is {value}, not an exact number")
    return value


def _mismatch(derived: Any, answer: Any) -> Reject:
    return Reject("logic:answer_mismatch", f"derived {derived}, answer says {answer}")


def logic(topic: str, problem: dict[str, Any], parsed: _Parsed, question: str) -> str:
    """Stage 2: re-derive the answer; returns how it was checked."""
    answer = parsed["answer"]
    if topic == "arithmetic":
        value = _expect_rational(parsed["expr"], "the expression")
        if value != answer:
            raise _mismatch(value, answer)
        how = "exact rational evaluation"
    elif topic == "linear":
        poly = sp.Poly(parsed["eq"], parsed["var"])
        if poly.degree() != 1:
            raise Reject("logic:wrong_degree", f"equation has degree {poly.degree()}, not 1")
        a, b = poly.all_coeffs()
        value = -b / a
        if not _same(value, answer):
            raise _mismatch(value, answer)
        how = "solved from Poly coefficients"
    elif topic == "quadratic":
        poly = sp.Poly(parsed["eq"], parsed["var"])
        if poly.degree() != 2:
            raise Reject("logic:wrong_degree", f"equation has degree {poly.degree()}, not 2")
        derived = list(dict.fromkeys(roots_quadratic(poly)))
        given = list(answer) if isinstance(answer, list | tuple) else [answer]
        if len(given) != len(derived) or not all(
            any(_same(r, g) for g in given) for r in derived
        ):
            raise _mismatch(derived, given)
        how = "sympy roots_quadratic"
    elif topic == "system":
        x, y = parsed["vars"]
        rows, rhs = [], []
        for eq in parsed["eqs"]:
            poly = sp.Poly(eq, x, y)
            if poly.total_degree() != 1:
                raise Reject("logic:wrong_degree", "equations must be linear")
            rows.append([poly.coeff_monomial(x), poly.coeff_monomial(y)])
            rhs.append(-poly.coeff_monomial(1))
        matrix = sp.Matrix(rows)
        if matrix.det() == 0:
            raise Reject("logic:degenerate", "singular system")
        solution = list(matrix.LUsolve(sp.Matrix(rhs)))
        given = list(answer) if isinstance(answer, tuple | list) else [answer]
        if len(given) != 2 or not all(_same(s, g) for s, g in zip(solution, given, strict=True)):
            raise _mismatch(tuple(solution), answer)
        how = "LU solve of the coefficient matrix"
    elif topic == "derivative":
        x, f = parsed["var"], parsed["f"]
        derived = sp.diff(f, x)
        if not _same(derived, answer):
            raise _mismatch(derived, answer)
        if not _numeric_derivative_match(parsed["f_tree"], parsed["answer_tree"], str(x)):
            raise Reject("logic:numeric_mismatch", "finite differences disagree with the answer")
        how = "sympy.diff + finite differences"
    elif topic == "integral":
        x, f = parsed["var"], parsed["f"]
        if "bounds" in parsed:
            lo, hi = parsed["bounds"]
            try:
                prim = sp.Poly(f, x).integrate()
            except sp.PolynomialError:
                raise Reject("logic:not_polynomial", "definite integrals are of polynomials") \
                    from None
            value = prim.eval(hi) - prim.eval(lo)
            if not _same(value, answer):
                raise _mismatch(value, answer)
            how = "Poly.integrate at the bounds"
        else:
            if not _same(sp.diff(answer, x), f):
                raise _mismatch(f"d/d{x} of the answer = {sp.diff(answer, x)}", f)
            if not _numeric_derivative_match(parsed["answer_tree"], parsed["f_tree"], str(x)):
                raise Reject("logic:numeric_mismatch", "the answer's finite differences "
                             "disagree with the integrand")
            how = "derivative of the answer + finite differences"
    elif topic == "gcd":
        numbers = parsed["numbers"]
        if any(n <= 0 for n in numbers):
            raise Reject("logic:degenerate", "numbers must be positive")
        value = sp.igcd(*numbers) if problem["op"] == "gcd" else sp.ilcm(*numbers)
        if value != answer:
            raise _mismatch(value, answer)
        how = f"sympy.i{problem['op']}"
    elif topic == "modular":
        a, b, m, op = parsed["a"], parsed["b"], parsed["m"], problem["op"]
        if m < 2:
            raise Reject("logic:degenerate", "modulus must be >= 2")
        if op in ("inverse", "congruence") and sp.igcd(a, m) != 1:
            raise Reject("logic:degenerate", f"{a} is not invertible modulo {m}")
        if op == "powmod" and b > _MAX_EXPONENT:
            raise Reject("logic:degenerate", "exponent too large")
        value = {
            "mod": lambda: sp.Mod(a, m), "mulmod": lambda: sp.Mod(sp.Integer(a) * b, m),
            "powmod": lambda: sp.Mod(sp.Integer(a) ** b, m),
            "inverse": lambda: sp.mod_inverse(a, m),
            "congruence": lambda: sp.Mod(sp.mod_inverse(a, m) * b, m),
        }.get(op, lambda: None)()
        if value is None:
            raise Reject("syntax:bad_field", f"unknown op {op!r}")
        if value != answer:
            raise _mismatch(value, answer)
        how = "sympy Mod / mod_inverse"
    else:
        n, op = parsed["n"], problem["op"]
        if op == "isprime":
            value = "yes" if sp.isprime(n) else "no"
            ok = value == answer
        elif op == "nth":
            value = sp.prime(n)
            ok = value == answer
        elif op == "count":
            value = sp.primepi(n)
            ok = value == answer
        elif op == "factor":
            value = sp.factorint(n)
            claimed: dict[int, int] = {}
            for factor in sp.Mul.make_args(answer):
                base, exp = factor.as_base_exp()
                if not (base.is_Integer and exp.is_Integer) or int(base) in claimed:
                    claimed = {}
                    break
                claimed[int(base)] = int(exp)
            ok = claimed == value
        elif op == "largest_factor":
            value = max(sp.factorint(n)) if n > 1 else None
            ok = value == answer
        else:
            raise Reject("syntax:bad_field", f"unknown op {op!r}")
        if not ok:
            raise _mismatch(value, answer)
        how = f"sympy ({op})"
    squashed = _squash(question)
    missing = [s for s in _stated(topic, problem) if _squash(s) not in squashed]
    if missing:
        raise Reject("logic:question_mismatch", f"the question does not state {missing[0]!r}")
    return how


def verify(topic: str, question: Any, answer: Any, problem: Any) -> list[Check]:
    """Both stages; the trail ends at the first failed check."""
    trail: list[Check] = []
    if not isinstance(question, str) or not question.strip():
        return [Check("syntax", False, "syntax:empty", "question must be a non-empty string")]
    try:
        parsed = syntax(topic, problem, answer)
    except Reject as exc:
        return [Check("syntax", False, exc.code, exc.detail)]
    except (TypeError, ValueError, AttributeError) as exc:
        return [Check("syntax", False, "syntax:bad_field", f"{type(exc).__name__}: {exc}")]
    trail.append(Check("syntax", True, "parsed", "every expression parses with sympy"))
    try:
        how = logic(topic, problem, parsed, question)
    except Reject as exc:
        trail.append(Check("logic", False, exc.code, exc.detail))
        return trail
    except (TypeError, ValueError, ArithmeticError, AttributeError, sp.PolynomialError) as exc:
        trail.append(Check("logic", False, "logic:error", f"{type(exc).__name__}: {exc}"))
        return trail
    trail.append(Check("logic", True, "re-derived", how))
    return trail
