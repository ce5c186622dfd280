"""Algorithmic stdin/stdout tasks: statement, reference solution and an independent oracle.

A family is `sample(rng, difficulty) -> params` (constants of the statement, input sizes and a
test seed) and `build(params, tests) -> CodeBuilt`. The reference is the efficient solution a
record ships; the oracle is a deliberately different (usually brute-force) solution the logic stage
runs against the reference's outputs in the sandbox, so a wrong reference is caught. Expected
outputs are never computed on the host: they come from running the reference in the sandbox.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .math_topics import Degenerate


@dataclass(frozen=True)
class CodeBuilt:
    statement: str
    reference: str
    oracle: str
    inputs: list[str]


def _size(d: int, lo: int, hi: int) -> int:
    """Largest input size at difficulty d, growing geometrically from lo (d=1) to hi (d=5)."""
    return int(lo * (hi / lo) ** ((d - 1) / 4))


def _ints_input(rng: random.Random, n: int, lo: int, hi: int) -> str:
    values = [rng.randint(lo, hi) for _ in range(n)]
    return f"{n}\n{' '.join(map(str, values))}\n"


# Each family: (sample, build). Sources read all of stdin and print one answer line.

def _count_divisible(rng: random.Random, d: int) -> dict[str, Any]:
    return {"k": rng.randint(2, 9 + d), "n": _size(d, 8, 2000), "v": 10 ** (1 + d),
            "test_seed": rng.getrandbits(32)}


def _count_divisible_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    k, n, v = p["k"], p["n"], p["v"]
    if k < 2 or n < 1 or v < 1:
        raise Degenerate("need k >= 2, n >= 1, v >= 1")
    rng = random.Random(p["test_seed"])
    return CodeBuilt(
        f"You are given n integers. Print how many of them are divisible by {k}.\n"
        f"Input: the first line holds n (1 <= n <= {n}); the second line holds the n integers, "
        f"each between -{v} and {v}.\nOutput: one integer.",
        f"import sys\ndata = sys.stdin.read().split()\nn = int(data[0])\n"
        f"print(sum(1 for t in data[1:n + 1] if int(t) % {k} == 0))\n",
        f"import sys\ndata = sys.stdin.read().split()\ncount = 0\nfor t in data[1:]:\n"
        f"    value = abs(int(t))\n    while value >= {k}:\n        value -= {k}\n"
        f"    count += value == 0\nprint(count)\n",
        [_ints_input(rng, rng.randint(1, n), -v, v) for _ in range(tests)],
    )


def _caesar(rng: random.Random, d: int) -> dict[str, Any]:
    return {"shift": rng.randint(1, 25), "n": _size(d, 10, 400), "test_seed": rng.getrandbits(32)}


def _caesar_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    shift, n = p["shift"], p["n"]
    if not 1 <= shift <= 25 or n < 1:
        raise Degenerate("shift must be in 1..25")
    rng = random.Random(p["test_seed"])
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    inputs = ["".join(rng.choice(alphabet + " .,") for _ in range(rng.randint(1, n))).strip()
              or "a" for _ in range(tests)]
    return CodeBuilt(
        f"Encrypt a line of text with a Caesar cipher: replace every lowercase letter by the "
        f"letter {shift} positions later in the alphabet, wrapping from z to a; keep every other "
        f"character.\nInput: one line of at most {n} characters.\nOutput: the encrypted line.",
        "import string\nimport sys\nline = sys.stdin.readline().rstrip('\\n')\n"
        f"table = str.maketrans(string.ascii_lowercase, string.ascii_lowercase[{shift}:] + "
        f"string.ascii_lowercase[:{shift}])\nprint(line.translate(table))\n",
        "import sys\nline = sys.stdin.readline().rstrip('\\n')\nout = []\nfor ch in line:\n"
        f"    out.append(chr((ord(ch) - 97 + {shift}) % 26 + 97) if 'a' <= ch <= 'z' else ch)\n"
        "print(''.join(out))\n",
        [line + "\n" for line in inputs],
    )


def _kth(rng: random.Random, d: int) -> dict[str, Any]:
    return {"k": rng.randint(1, 2 + d), "n": _size(d, 6, 300), "v": 10 * d,
            "test_seed": rng.getrandbits(32)}


def _kth_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    k, n, v = p["k"], p["n"], p["v"]
    if k < 1 or n < 1 or v < 1:
        raise Degenerate("need k, n, v >= 1")
    rng = random.Random(p["test_seed"])
    return CodeBuilt(
        f"Given n integers, print the {k}-th smallest distinct value among them, or -1 if there "
        f"are fewer than {k} distinct values.\nInput: n (1 <= n <= {n}), then n integers in "
        f"[0, {v}].\nOutput: one integer.",
        f"import sys\ndata = list(map(int, sys.stdin.read().split()))\n"
        f"values = sorted(set(data[1:data[0] + 1]))\nprint(values[{k - 1}] if len(values) >= {k} "
        "else -1)\n",
        f"import sys\ndata = list(map(int, sys.stdin.read().split()))\nrest = data[1:]\n"
        f"answer = -1\nfor _ in range({k}):\n    if not rest:\n        answer = -1\n        break\n"
        "    answer = min(rest)\n    rest = [t for t in rest if t != answer]\nprint(answer)\n",
        [_ints_input(rng, rng.randint(1, n), 0, v) for _ in range(tests)],
    )


def _brackets(rng: random.Random, d: int) -> dict[str, Any]:
    kinds = rng.sample(["()", "[]", "{}", "<>"], k=min(4, 1 + (d + 1) // 2))
    return {"pairs": "".join(kinds), "n": _size(d, 8, 200), "test_seed": rng.getrandbits(32)}


def _brackets_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    pairs, n = p["pairs"], p["n"]
    if not pairs or len(pairs) % 2 or n < 2:
        raise Degenerate("pairs must be an even string of bracket characters")
    rng = random.Random(p["test_seed"])
    inputs = []
    for _ in range(tests):
        stack: list[str] = []
        out: list[str] = []
        for _ in range(rng.randint(1, n // 2)):  # mostly balanced strings, some corrupted
            if stack and rng.random() < 0.5:
                out.append(stack.pop())
            else:
                i = rng.randrange(len(pairs) // 2) * 2
                out.append(pairs[i])
                stack.append(pairs[i + 1])
        out.extend(reversed(stack))
        if rng.random() < 0.5:
            out[rng.randrange(len(out))] = rng.choice(pairs)
        inputs.append("".join(out) + "\n")
    shown = " ".join(pairs[i:i + 2] for i in range(0, len(pairs), 2))
    return CodeBuilt(
        f"A string uses the bracket pairs {shown}. Print YES if it is balanced (every bracket "
        f"closed by its own kind, properly nested) and NO otherwise.\nInput: one line of at most "
        f"{n} bracket characters.\nOutput: YES or NO.",
        f"import sys\ns = sys.stdin.readline().strip()\npairs = {pairs!r}\n"
        "match = {pairs[i + 1]: pairs[i] for i in range(0, len(pairs), 2)}\nstack = []\nok = True\n"
        "for ch in s:\n    if ch in match:\n        if not stack or stack.pop() != match[ch]:\n"
        "            ok = False\n            break\n    else:\n        stack.append(ch)\n"
        "print('YES' if ok and not stack else 'NO')\n",
        f"import sys\ns = sys.stdin.readline().strip()\npairs = {pairs!r}\n"
        "empties = [pairs[i:i + 2] for i in range(0, len(pairs), 2)]\nwhile True:\n    before = s\n"
        "    for e in empties:\n        s = s.replace(e, '')\n    if s == before:\n        break\n"
        "print('YES' if not s else 'NO')\n",
        inputs,
    )


def _max_subarray(rng: random.Random, d: int) -> dict[str, Any]:
    return {"n": _size(d, 8, 300), "v": 10 * d, "test_seed": rng.getrandbits(32)}


def _max_subarray_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    n, v = p["n"], p["v"]
    if n < 1 or v < 1:
        raise Degenerate("need n, v >= 1")
    rng = random.Random(p["test_seed"])
    return CodeBuilt(
        f"Print the largest sum of a non-empty contiguous subarray.\nInput: n (1 <= n <= {n}), "
        f"then n integers in [-{v}, {v}].\nOutput: one integer.",
        "import sys\ndata = list(map(int, sys.stdin.read().split()))\na = data[1:data[0] + 1]\n"
        "best = cur = a[0]\nfor x in a[1:]:\n    cur = max(x, cur + x)\n    best = max(best, cur)\n"
        "print(best)\n",
        "import sys\ndata = list(map(int, sys.stdin.read().split()))\na = data[1:]\n"
        "print(max(sum(a[i:j + 1]) for i in range(len(a)) for j in range(i, len(a))))\n",
        [_ints_input(rng, rng.randint(1, n), -v, v) for _ in range(tests)],
    )


def _coin_change(rng: random.Random, d: int) -> dict[str, Any]:
    coins = sorted(rng.sample(range(1, 12 + 3 * d), k=min(2 + d // 2, 6)))
    return {"coins": coins, "amount": 10 * d + 20, "mod": rng.choice([1_000_000_007, 998_244_353,
                                                                        10_007]),
            "test_seed": rng.getrandbits(32)}


def _coin_change_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    coins, amount, mod = p["coins"], p["amount"], p["mod"]
    if not coins or any(c < 1 for c in coins) or len(set(coins)) != len(coins) or mod < 2:
        raise Degenerate("coins must be distinct positive values, mod >= 2")
    rng = random.Random(p["test_seed"])
    shown = ", ".join(map(str, coins))
    return CodeBuilt(
        f"Coins have the values {shown} (unlimited supply of each). Print the number of "
        f"different multisets of coins that sum to A, modulo {mod}.\nInput: one integer A "
        f"(0 <= A <= {amount}).\nOutput: one integer.",
        f"import sys\na = int(sys.stdin.read())\nways = [1] + [0] * a\nfor c in {coins!r}:\n"
        f"    for s in range(c, a + 1):\n        ways[s] = (ways[s] + ways[s - c]) % {mod}\n"
        "print(ways[a])\n",
        f"import sys\nfrom functools import lru_cache\nsys.setrecursionlimit(10000)\n"
        f"coins = {coins!r}\n@lru_cache(maxsize=None)\ndef count(i, left):\n"
        "    if left == 0:\n        return 1\n"
        "    if i == len(coins) or left < 0:\n        return 0\n"
        "    return count(i, left - coins[i]) + count(i + 1, left)\n"
        f"print(count(0, int(sys.stdin.read())) % {mod})\n",
        [f"{rng.randint(0, amount)}\n" for _ in range(tests)],
    )


def _lis(rng: random.Random, d: int) -> dict[str, Any]:
    return {"n": _size(d, 8, 250), "v": 5 * d * d, "test_seed": rng.getrandbits(32)}


def _lis_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    n, v = p["n"], p["v"]
    if n < 1 or v < 1:
        raise Degenerate("need n, v >= 1")
    rng = random.Random(p["test_seed"])
    return CodeBuilt(
        f"Print the length of the longest strictly increasing subsequence.\nInput: n "
        f"(1 <= n <= {n}), then n integers in [0, {v}].\nOutput: one integer.",
        "import sys\nfrom bisect import bisect_left\n"
        "data = list(map(int, sys.stdin.read().split()))\n"
        "tails = []\nfor x in data[1:data[0] + 1]:\n    i = bisect_left(tails, x)\n"
        "    if i == len(tails):\n        tails.append(x)\n    else:\n        tails[i] = x\n"
        "print(len(tails))\n",
        "import sys\ndata = list(map(int, sys.stdin.read().split()))\na = data[1:]\n"
        "best = [1] * len(a)\nfor i in range(len(a)):\n    for j in range(i):\n"
        "        if a[j] < a[i]:\n            best[i] = max(best[i], best[j] + 1)\n"
        "print(max(best))\n",
        [_ints_input(rng, rng.randint(1, n), 0, v) for _ in range(tests)],
    )


def _grid_paths(rng: random.Random, d: int) -> dict[str, Any]:
    return {"size": 2 + 2 * d, "block": rng.choice([10, 15, 20, 25]), "mod": 1_000_000_007,
            "test_seed": rng.getrandbits(32)}


def _grid_paths_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    size, block, mod = p["size"], p["block"], p["mod"]
    if not 1 <= size <= 30 or not 0 <= block <= 60 or mod < 2:
        raise Degenerate("size in 1..30, block in 0..60 percent, mod >= 2")
    rng = random.Random(p["test_seed"])
    inputs = []
    for _ in range(tests):
        r, c = rng.randint(1, size), rng.randint(1, size)
        rows = ["".join("#" if rng.randrange(100) < block else "." for _ in range(c))
                for _ in range(r)]
        inputs.append(f"{r} {c}\n" + "\n".join(rows) + "\n")
    return CodeBuilt(
        f"A grid has free cells '.' and walls '#'. Count the paths from the top-left to the "
        f"bottom-right cell moving only right or down through free cells; print the count modulo "
        f"{mod} (0 if either corner is a wall).\nInput: R and C (1 <= R, C <= {size}), then R "
        "lines of C characters.\nOutput: one integer.",
        "import sys\nlines = sys.stdin.read().split()\nr, c = int(lines[0]), int(lines[1])\n"
        "g = lines[2:2 + r]\nways = [[0] * c for _ in range(r)]\nfor i in range(r):\n"
        "    for j in range(c):\n        if g[i][j] == '#':\n            continue\n"
        "        if i == 0 and j == 0:\n            ways[i][j] = 1\n            continue\n"
        "        ways[i][j] = ((ways[i - 1][j] if i else 0) + (ways[i][j - 1] if j else 0))"
        f" % {mod}\nprint(ways[r - 1][c - 1])\n",
        "import sys\nfrom functools import lru_cache\nlines = sys.stdin.read().split()\n"
        "r, c = int(lines[0]), int(lines[1])\ng = lines[2:2 + r]\n@lru_cache(maxsize=None)\n"
        "def paths(i, j):\n    if i >= r or j >= c or g[i][j] == '#':\n        return 0\n"
        "    if (i, j) == (r - 1, c - 1):\n        return 1\n"
        "    return paths(i + 1, j) + paths(i, j + 1)\n"
        f"print(paths(0, 0) % {mod})\n",
        inputs,
    )


def _edit_distance(rng: random.Random, d: int) -> dict[str, Any]:
    return {"ins": rng.randint(1, 3), "dele": rng.randint(1, 3), "sub": rng.randint(1, 4),
            "n": 3 + 2 * d, "test_seed": rng.getrandbits(32)}


def _edit_distance_build(p: dict[str, Any], tests: int) -> CodeBuilt:
    ins, dele, sub, n = p["ins"], p["dele"], p["sub"], p["n"]
    if min(ins, dele, sub) < 1 or not 1 <= n <= 40:
        raise Degenerate("costs must be >= 1 and n in 1..40")
    rng = random.Random(p["test_seed"])
    word = lambda: "".join(rng.choice("abc") for _ in range(rng.randint(1, n)))  # noqa: E731
    return CodeBuilt(
        f"Transform word S into word T with insertions (cost {ins}), deletions (cost {dele}) "
        f"and substitutions (cost {sub}). Print the minimum total cost.\nInput: S on the first "
        f"line and T on the second, each of 1 to {n} lowercase letters.\nOutput: one integer.",
        "import sys\ns, t = sys.stdin.read().split()\nprev = [j * " + str(ins) + " for j in "
        "range(len(t) + 1)]\nfor i in range(1, len(s) + 1):\n    cur = [i * " + str(dele)
        + "] + [0] * len(t)\n    for j in range(1, len(t) + 1):\n"
        f"        cur[j] = min(prev[j] + {dele}, cur[j - 1] + {ins}, prev[j - 1] + "
        f"(0 if s[i - 1] == t[j - 1] else {sub}))\n    prev = cur\nprint(prev[-1])\n",
        "import sys\nfrom functools import lru_cache\ns, t = sys.stdin.read().split()\n"
        "@lru_cache(maxsize=None)\ndef cost(i, j):\n"
        f"    if i == 0:\n        return j * {ins}\n    if j == 0:\n        return i * {dele}\n"
        f"    same = 0 if s[i - 1] == t[j - 1] else {sub}\n"
        f"    return min(cost(i - 1, j) + {dele}, cost(i, j - 1) + {ins},\n"
        "               cost(i - 1, j - 1) + same)\n"
        "print(cost(len(s), len(t)))\n",
        [f"{word()}\n{word()}\n" for _ in range(tests)],
    )


@dataclass(frozen=True)
class Family:
    sample: Callable[[random.Random, int], dict[str, Any]]
    build: Callable[[dict[str, Any], int], CodeBuilt]


FAMILIES: dict[str, Family] = {
    "count_divisible": Family(_count_divisible, _count_divisible_build),
    "caesar": Family(_caesar, _caesar_build),
    "kth_smallest": Family(_kth, _kth_build),
    "brackets": Family(_brackets, _brackets_build),
    "max_subarray": Family(_max_subarray, _max_subarray_build),
    "coin_change": Family(_coin_change, _coin_change_build),
    "lis": Family(_lis, _lis_build),
    "grid_paths": Family(_grid_paths, _grid_paths_build),
    "edit_distance": Family(_edit_distance, _edit_distance_build),
}
