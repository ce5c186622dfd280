"""Tools an environment executes for the model: an exact calculator and sandboxed Python."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from workers.envs.base import InfraError, Tool
from workers.envs.checkers import Sandbox
from workers.sandbox.spec import ExecutionRequest, Limits, Status

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPRESSION = 500
MAX_EXPONENT = 1_000
MAX_DIGITS = 4_000


def calculate(expression: str) -> Fraction:
    """Exact rational arithmetic over + - * / // % ** and parentheses; nothing else parses."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    tree = ast.parse(expression.replace("^", "**"), mode="eval")

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1
                                                 or abs(right) > MAX_EXPONENT):
                raise ValueError(f"exponents must be integers within ±{MAX_EXPONENT}")
            result = _BINARY[type(node.op)](left, right)
            if len(str(result.numerator)) + len(str(result.denominator)) > MAX_DIGITS:
                raise ValueError("result too large")
            return Fraction(result)
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    return ev(tree)


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else (
        f"{value.numerator}/{value.denominator} (≈{float(value):.10g})")


def calculator_tool() -> Tool:
    def run(args: Mapping[str, Any]) -> str:
        expression = args.get("expression")
        if not isinstance(expression, str):
            return 'error: call calculator with {"expression": "<arithmetic>"}'
        try:
            return format_number(calculate(expression))
        except (ValueError, SyntaxError, ZeroDivisionError) as exc:
            return f"error: {exc}"

    return Tool(
        name="calculator", run=run,
        description="Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
        parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]},
    )


def python_tool(sandbox: Sandbox, limits: Limits | None = None) -> Tool:
    limits = limits or Limits(wall_ms=5_000, cpu_ms=3_000, output_bytes=16 << 10)

    def run(args: Mapping[str, Any]) -> str:
        code = args.get("code")
        if not isinstance(code, str):
            return 'error: call python with {"code": "<program>"}'
        [result] = sandbox.run([ExecutionRequest(language="python", code=code, limits=limits)])
        if result.status == Status.SANDBOX_ERROR:  # the engine's failure, not the program's
            raise InfraError(f"the python tool's sandbox failed: {result.message}")
        out = f"status: {result.status}\nstdout:\n{result.stdout[-4000:]}"
        if result.stderr.strip():
            out += f"\nstderr:\n{result.stderr[-2000:]}"
        return out

    return Tool(
        name="python", run=run,
        description="Run a Python program in a sandbox (no network); returns stdout and stderr.",
        parameters={"type": "object", "properties": {"code": {"type": "string"}},
                    "required": ["code"]},
    )


def build_tools(names: list[str], sandbox: Sandbox) -> list[Tool]:
    makers: dict[str, Callable[[], Tool]] = {
        "calculator": calculator_tool, "python": lambda: python_tool(sandbox)}
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; known: {sorted(makers)}")
    return [makers[n]() for n in names]
