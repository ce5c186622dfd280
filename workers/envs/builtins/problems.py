"""A small bank of Python function problems for the `code` and `code_repair` environments.

Each has a statement, a correct solution, a buggy variant (the repair environment's starting
point: it fails at least one test) and assert tests. Written for this project.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    slug: str
    topic: str
    difficulty: str
    statement: str
    solution: str
    buggy: str
    tests: str


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "sum_of_squares", "loops", "easy",
        "Write `sum_of_squares(n)` returning 1^2 + 2^2 + ... + n^2 (0 for n <= 0).",
        "def sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))\n",
        "def sum_of_squares(n):\n    return sum(i * i for i in range(1, n))\n",
        "assert sum_of_squares(0) == 0\nassert sum_of_squares(1) == 1\n"
        "assert sum_of_squares(3) == 14\nassert sum_of_squares(10) == 385\n"
        "assert sum_of_squares(-2) == 0\n",
    ),
    Problem(
        "reverse_words", "strings", "easy",
        "Write `reverse_words(s)` returning the words of `s` in reverse order, joined by single "
        "spaces (words are separated by any whitespace).",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split(' ')))\n",
        "assert reverse_words('a b c') == 'c b a'\nassert reverse_words('  hello   world ') == "
        "'world hello'\nassert reverse_words('') == ''\nassert reverse_words('one') == 'one'\n",
    ),
    Problem(
        "is_palindrome", "strings", "easy",
        "Write `is_palindrome(s)`: True if `s` reads the same backwards considering only "
        "letters and digits, ignoring case.",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n"
        "    return t == t[::-1]\n",
        "def is_palindrome(s):\n    t = [c for c in s if c.isalnum()]\n    return t == t[::-1]\n",
        "assert is_palindrome('A man, a plan, a canal: Panama')\nassert not is_palindrome('abc')\n"
        "assert is_palindrome('')\nassert is_palindrome('No lemon, no melon')\n",
    ),
    Problem(
        "fizzbuzz", "loops", "easy",
        "Write `fizzbuzz(n)` returning a list of strings for 1..n: 'Fizz' for multiples of 3, "
        "'Buzz' for multiples of 5, 'FizzBuzz' for both, else the number.",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
        "        out.append(s or str(i))\n    return out\n",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        if i % 3 == 0:\n            out.append('Fizz')\n        elif i % 5 == 0:\n"
        "            out.append('Buzz')\n        else:\n            out.append(str(i))\n"
        "    return out\n",
        "assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']\n"
        "assert fizzbuzz(15)[-1] == 'FizzBuzz'\nassert fizzbuzz(0) == []\n",
    ),
    Problem(
        "gcd", "math", "easy",
        "Write `gcd(a, b)` returning the greatest common divisor of two non-negative integers "
        "(gcd(0, 0) == 0), without importing math.",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        "def gcd(a, b):\n    while b > 1:\n        a, b = b, a % b\n    return a\n",
        "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1\nassert gcd(0, 9) == 9\n"
        "assert gcd(0, 0) == 0\nassert gcd(100, 75) == 25\n",
    ),
    Problem(
        "running_max", "lists", "easy",
        "Write `running_max(xs)` returning a list whose i-th item is max(xs[:i+1]).",
        "def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
        "        best = x if best is None or x > best else best\n        out.append(best)\n"
        "    return out\n",
        "def running_max(xs):\n    out, best = [], 0\n    for x in xs:\n"
        "        best = max(best, x)\n        out.append(best)\n    return out\n",
        "assert running_max([1, 3, 2, 5]) == [1, 3, 3, 5]\nassert running_max([]) == []\n"
        "assert running_max([-3, -5, -1]) == [-3, -3, -1]\n",
    ),
    Problem(
        "count_vowels", "strings", "easy",
        "Write `count_vowels(s)` returning how many characters of `s` are vowels (a e i o u, "
        "either case).",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
        "assert count_vowels('Hello World') == 3\nassert count_vowels('') == 0\n"
        "assert count_vowels('AEIOUxyz') == 5\n",
    ),
    Problem(
        "flatten", "lists", "medium",
        "Write `flatten(xs)` that flattens arbitrarily nested lists into one flat list, keeping "
        "order.",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n"
        "            out.extend(flatten(x))\n        else:\n            out.append(x)\n"
        "    return out\n",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n"
        "            out.extend(x)\n        else:\n            out.append(x)\n    return out\n",
        "assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]\nassert flatten([]) == []\n"
        "assert flatten([[], [[]]]) == []\nassert flatten(['a', ['b']]) == ['a', 'b']\n",
    ),
    Problem(
        "binary_search", "algorithms", "medium",
        "Write `binary_search(xs, target)` returning an index of `target` in the sorted list "
        "`xs`, or -1 if absent.",
        "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n"
        "        if xs[mid] < target:\n            lo = mid + 1\n        else:\n"
        "            hi = mid - 1\n    return -1\n",
        "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n"
        "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n"
        "        if xs[mid] < target:\n            lo = mid + 1\n        else:\n"
        "            hi = mid - 1\n    return -1\n",
        "assert binary_search([1, 3, 5, 7], 7) == 3\nassert binary_search([1, 3, 5, 7], 4) == -1\n"
        "assert binary_search([], 1) == -1\nassert binary_search([2], 2) == 0\n"
        "assert binary_search(list(range(0, 100, 2)), 64) == 32\n",
    ),
    Problem(
        "word_counts", "dicts", "medium",
        "Write `word_counts(text)` returning a dict from each lower-cased word (split on "
        "whitespace) to how often it occurs.",
        "def word_counts(text):\n    counts = {}\n    for w in text.lower().split():\n"
        "        counts[w] = counts.get(w, 0) + 1\n    return counts\n",
        "def word_counts(text):\n    counts = {}\n    for w in text.split():\n"
        "        counts[w] = counts.get(w, 0) + 1\n    return counts\n",
        "assert word_counts('a b a') == {'a': 2, 'b': 1}\nassert word_counts('') == {}\n"
        "assert word_counts('The the THE') == {'the': 3}\n",
    ),
    Problem(
        "rle_encode", "strings", "medium",
        "Write `rle_encode(s)` returning the run-length encoding of `s`: each run as the "
        "character followed by the run length, e.g. 'aaab' -> 'a3b1'.",
        "def rle_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        "        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
        "def rle_encode(s):\n    out, i = [], 0\n    while i < len(s) - 1:\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        "        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
        "assert rle_encode('aaab') == 'a3b1'\nassert rle_encode('') == ''\n"
        "assert rle_encode('abc') == 'a1b1c1'\nassert rle_encode('zzzz') == 'z4'\n",
    ),
    Problem(
        "primes_below", "math", "medium",
        "Write `primes_below(n)` returning the sorted list of primes smaller than `n`.",
        "def primes_below(n):\n    if n < 3:\n        return []\n    sieve = [True] * n\n"
        "    sieve[0] = sieve[1] = False\n    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if sieve[i]:\n            sieve[i * i::i] = [False] * len(range(i * i, n, i))\n"
        "    return [i for i, p in enumerate(sieve) if p]\n",
        "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in "
        "range(2, int(p ** 0.5)))]\n",
        "assert primes_below(10) == [2, 3, 5, 7]\nassert primes_below(2) == []\n"
        "assert primes_below(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]\n"
        "assert len(primes_below(1000)) == 168\n",
    ),
    Problem(
        "merge_intervals", "algorithms", "hard",
        "Write `merge_intervals(intervals)` merging overlapping [start, end] pairs (touching "
        "intervals merge too) and returning them sorted by start as lists.",
        "def merge_intervals(intervals):\n    out = []\n"
        "    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], e)\n        else:\n"
        "            out.append([s, e])\n    return out\n",
        "def merge_intervals(intervals):\n    out = []\n"
        "    for s, e in sorted(intervals):\n        if out and s < out[-1][1]:\n"
        "            out[-1][1] = e\n        else:\n            out.append([s, e])\n"
        "    return out\n",
        "assert merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]\n"
        "assert merge_intervals([[1, 4], [4, 5]]) == [[1, 5]]\nassert merge_intervals([]) == []\n"
        "assert merge_intervals([[1, 10], [2, 3]]) == [[1, 10]]\n",
    ),
    Problem(
        "balanced_brackets", "algorithms", "medium",
        "Write `balanced(s)`: True if every bracket in `s` ((), [], {}) is closed in the right "
        "order; other characters are ignored.",
        "def balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
        "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return not stack\n",
        "def balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
        "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return True\n",
        "assert balanced('([]{})')\nassert not balanced('([)]')\nassert not balanced('((')\n"
        "assert balanced('a(b)c')\nassert balanced('')\n",
    ),
    Problem(
        "roman_to_int", "strings", "medium",
        "Write `roman_to_int(s)` converting a Roman numeral (I V X L C D M, subtractive "
        "notation) to an integer.",
        "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, "
        "'M': 1000}\n    total = 0\n    for i, c in enumerate(s):\n"
        "        if i + 1 < len(s) and v[c] < v[s[i + 1]]:\n            total -= v[c]\n"
        "        else:\n            total += v[c]\n    return total\n",
        "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, "
        "'M': 1000}\n    return sum(v[c] for c in s)\n",
        "assert roman_to_int('III') == 3\nassert roman_to_int('IV') == 4\n"
        "assert roman_to_int('MCMXCIV') == 1994\nassert roman_to_int('LVIII') == 58\n",
    ),
    Problem(
        "transpose", "lists", "easy",
        "Write `transpose(m)` returning the transpose of a rectangular matrix given as a list of "
        "rows (an empty matrix stays []).",
        "def transpose(m):\n    return [list(col) for col in zip(*m)]\n",
        "def transpose(m):\n    return [list(row) for row in m]\n",
        "assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]\n"
        "assert transpose([]) == []\nassert transpose([[7]]) == [[7]]\n",
    ),
    Problem(
        "second_largest", "lists", "medium",
        "Write `second_largest(xs)` returning the second largest distinct value of `xs`, or "
        "None if there are fewer than two distinct values.",
        "def second_largest(xs):\n    distinct = sorted(set(xs))\n"
        "    return distinct[-2] if len(distinct) >= 2 else None\n",
        "def second_largest(xs):\n    ordered = sorted(xs)\n"
        "    return ordered[-2] if len(ordered) >= 2 else None\n",
        "assert second_largest([3, 1, 4, 4]) == 3\nassert second_largest([5, 5]) is None\n"
        "assert second_largest([]) is None\nassert second_largest([-1, -2]) == -2\n",
    ),
    Problem(
        "anagrams", "dicts", "medium",
        "Write `group_anagrams(words)` returning groups of words that are anagrams of each "
        "other: each group sorted, groups sorted by their first word.",
        "def group_anagrams(words):\n    groups = {}\n    for w in words:\n"
        "        groups.setdefault(''.join(sorted(w)), []).append(w)\n"
        "    return sorted(sorted(g) for g in groups.values())\n",
        "def group_anagrams(words):\n    groups = {}\n    for w in words:\n"
        "        groups.setdefault(len(w), []).append(w)\n"
        "    return sorted(sorted(g) for g in groups.values())\n",
        "assert group_anagrams(['eat', 'tea', 'tan', 'ate', 'nat', 'bat']) == "
        "[['ate', 'eat', 'tea'], ['bat'], ['nat', 'tan']]\nassert group_anagrams([]) == []\n",
    ),
    Problem(
        "digits_sum", "math", "easy",
        "Write `digit_sum(n)` returning the sum of the decimal digits of the integer `n` "
        "(the sign is ignored).",
        "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
        "def digit_sum(n):\n    return sum(int(d) for d in str(n) if d.isdigit() and d != '9')\n",
        "assert digit_sum(123) == 6\nassert digit_sum(-909) == 18\nassert digit_sum(0) == 0\n",
    ),
    Problem(
        "fibonacci", "math", "easy",
        "Write `fib(n)` returning the n-th Fibonacci number with fib(0) == 0 and fib(1) == 1, "
        "fast enough for n = 10_000.",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(10) == 55\n"
        "assert fib(10_000) % 1_000_000_007 == 271496360\n",
    ),
)


def prompt_for(problem: Problem) -> str:
    return (f"{problem.statement}\nReply with the complete function in one ```python code "
            "block.")


def repair_prompt_for(problem: Problem) -> str:
    return (f"{problem.statement}\nThis attempt has a bug:\n```python\n{problem.buggy}```\n"
            "Reply with the corrected complete function in one ```python code block.")


def fenced(code: str) -> str:
    return f"```python\n{code}```"
