"""Synthesis benchmark: verified math items/s on two cores, verified code items/s, and
near-duplicate detection on 100,000 records.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_synth` (`make
bench-synth`; code items need the sandbox: root and bubblewrap, else that figure is skipped).
Ends with one line per figure (no peer, so no ratio):
    <figure>: crucible=<value> target=<op><value>
The machine is shared and noisy: each figure is the median of its repeats; progress, the sample
batch's stage statistics and a load-independent CPU figure go to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time

from workers.synthesis import parse_config, synthesize
from workers.synthesis.code_stage import sandbox_unavailable
from workers.synthesis.quality import exact_duplicates, near_duplicates


def note(text: str) -> None:
    """Progress and context go to stderr; stdout carries only the figure lines."""
    print(text, file=sys.stderr, flush=True)


def math_rate(items: int, repeats: int) -> tuple[float, float, dict]:
    """Verified math items per second of the generate+verify phase with a process pool of two
    (pool start-up included), and the same per CPU-second of the workers (load-independent)."""
    rates, per_cpu, batch = [], [], None
    for r in range(repeats):
        config = parse_config({"seed": 100 + r, "workers": 2, "generators": [
            {"kind": "math", "count": items}], "dedup": {"near": False}})
        batch = synthesize(config)
        verified = batch.manifest["stages"][2]["passed"]
        rates.append(verified / batch.timings["math_s"])
        per_cpu.append(verified / batch.timings["math_cpu_s"])
    assert batch is not None
    return statistics.median(rates), statistics.median(per_cpu), batch.manifest


def code_rate(items: int, repeats: int) -> float:
    """Accepted code items per second: reference outputs plus the oracle check, 5 tests each,
    two sandboxes at a time."""
    rates = []
    for r in range(repeats):
        config = parse_config({"seed": 200 + r, "sandbox_concurrency": 2, "generators": [
            {"kind": "code", "count": items, "tests_per_item": 5}]})
        batch = synthesize(config)
        rates.append(batch.manifest["stages"][2]["passed"] / batch.timings["code_s"])
    return statistics.median(rates)


def corpus(questions: list[str], size: int, seed: int = 0) -> tuple[list[str], int]:
    """`size` texts: math questions with fresh numbers, plus 2% exact copies and 2% one-word
    edits of earlier texts (the duplicates the detector should find)."""
    rng = random.Random(seed)
    texts: list[str] = []
    planted = 0
    for i in range(size):
        roll = rng.random()
        if i > 100 and roll < 0.04:
            words = texts[rng.randrange(len(texts))].split()
            if roll < 0.02 and len(words) > 12:
                words[rng.randrange(len(words))] = "reworded"
            texts.append(" ".join(words))
            planted += 1
            continue
        base = questions[i % len(questions)]
        texts.append(re.sub(r"\d+", lambda _: str(rng.randint(0, 10**6)), base))
    return texts, planted


def dedup_time(texts: list[str], repeats: int) -> tuple[float, int]:
    times, found = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        exact = exact_duplicates(texts)
        near = near_duplicates(texts, threshold=0.8, skip=set(exact))
        times.append(time.perf_counter() - t)
        found = len(exact) + len(near)
    return statistics.median(times), found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--math-items", type=int, default=2000)
    parser.add_argument("--code-items", type=int, default=27)
    parser.add_argument("--dedup-records", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--figures", default="math,code,dedup",
                        help="comma-separated subset of math, code, dedup")
    args = parser.parse_args()
    figures = set(args.figures.split(","))
    lines = []

    if "math" in figures:
        math_per_s, math_per_cpu_s, manifest = math_rate(args.math_items, args.repeats)
        note(f"math items per worker CPU-second: {math_per_cpu_s:.1f} (two idle cores would "
             f"give about {2 * math_per_cpu_s:.0f}/s; the wall-clock figure depends on the load)")
        note("sample batch stages: " + json.dumps(manifest["stages"]))
        note("sample batch diversity: " + json.dumps(manifest["diversity"]))
        lines.append(f"math_items_per_s: crucible={math_per_s:.1f} target=>=200")
    if "code" in figures:
        reason = sandbox_unavailable()
        if reason:
            note(f"code items skipped: {reason}")
        else:
            rate = code_rate(args.code_items, args.repeats)
            lines.append(f"code_items_per_s: crucible={rate:.2f}")
    if "dedup" in figures:
        seed_batch = synthesize(parse_config({"seed": 9, "workers": 2, "generators": [
            {"kind": "math", "count": 360}], "dedup": {"near": False}}))
        texts, planted = corpus([r["question"] for r in seed_batch.records], args.dedup_records)
        seconds, found = dedup_time(texts, max(1, args.repeats - 1))
        note(f"dedup: {len(texts)} records, {planted} planted duplicates, {found} found")
        lines.append(f"dedup_{args.dedup_records // 1000}k_s: crucible={seconds:.1f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
