"""`make bench-filter`: the output filter against detect-secrets' own line scanner (the
library as its CLI uses it: every plugin, default settings) on the same texts.

Texts: model-style answers (prose and code, no secrets), and the same answers with one
planted secret or address each. Figures: throughput over all texts (MB/s), findings on the
clean texts (false positives; lower is better) and planted items found (recall).
"""

from __future__ import annotations

import random
import statistics
import time

from detect_secrets.core.scan import scan_line
from detect_secrets.settings import default_settings

from tests.workers.filtering.planted import SECRETS
from workers.filtering import find

ANSWERS = [
    "The sum of 17 and 25 is 42, so the answer is 42.",
    "To sort a list in place call xs.sort(); sorted(xs) returns a new list instead.",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "First compute 3 * 14 = 42, then subtract 7 to get 35. The final answer is 35.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "The function returns None when the key is missing; use dict.get(key, default).",
    "Let x = 12. Then 2x + 3 = 27, and x^2 = 144. Therefore the area is 144 square units.",
    "import numpy as np\narr = np.arange(10).reshape(2, 5)\nprint(arr.sum(axis=1))",
]
REPEATS = 5


def corpus(seed: int = 0) -> tuple[list[str], list[tuple[str, str]]]:
    rng = random.Random(seed)
    clean = [" ".join(rng.choice(ANSWERS) for _ in range(rng.randint(2, 6))) for _ in range(400)]
    planted = []
    for i, text in enumerate(clean[:100]):
        kind, secret = sorted(SECRETS.items())[i % len(SECRETS)]
        planted.append((kind, f"{text} Here it is: {secret} ok."))
    return clean, planted


def crucible_hits(text: str) -> list[str]:
    return [f.kind for f in find(text)]


def peer_hits(text: str) -> list[str]:
    return [s.type for line in text.splitlines() for s in scan_line(line)]


def measure(fn, texts: list[str]) -> float:
    """Median MB/s over REPEATS passes."""
    size = sum(len(t.encode()) for t in texts) / 1e6
    rates = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for t in texts:
            fn(t)
        rates.append(size / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    clean, planted = corpus()
    texts = clean + [t for _, t in planted]
    with default_settings():
        peer_rate = measure(peer_hits, texts)
        peer_fp = sum(len(peer_hits(t)) for t in clean)
        peer_found = sum(bool(peer_hits(t)) for _, t in planted)
    rate = measure(crucible_hits, texts)
    fp = sum(len(crucible_hits(t)) for t in clean)
    found = sum(kind in crucible_hits(t) for kind, t in planted)
    print(f"texts: {len(clean)} clean, {len(planted)} with one planted secret or address")
    print(f"filter_throughput_mb_s: crucible={rate:.2f} detect_secrets={peer_rate:.2f} "
          f"ratio={rate / peer_rate:.2f} target=>=1")
    print(f"filter_false_positives_on_clean: crucible={fp} detect_secrets={peer_fp} "
          f"target=<=0")
    print(f"filter_planted_found: crucible={found}/{len(planted)} "
          f"detect_secrets={peer_found}/{len(planted)} target=>={len(planted)}")


if __name__ == "__main__":
    main()
