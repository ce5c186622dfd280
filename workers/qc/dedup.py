"""Exact and near-duplicate prompts.

Exact: equal after lower-casing and collapsing whitespace. Near: Jaccard similarity of word
3-shingles at or above a threshold; MinHash LSH (datasketch) proposes candidate pairs and the
exact Jaccard of the shingle sets confirms them, so no pair is reported on a hash collision
(up to EXACT_LIMIT tasks every pair is compared directly: faster than building the index).
Word shingles keep templated problems that differ in a number apart (one changed number
touches three shingles of a short prompt), while copied prompts with light edits are caught.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from workers.envs.base import EnvTask

SHINGLE = 3
NUM_PERM = 128
EXACT_LIMIT = 2_000


def normalise(prompt: str) -> str:
    return " ".join(prompt.lower().split())


def shingles(prompt: str, size: int = SHINGLE) -> set[str]:
    words = normalise(prompt).split()
    if len(words) <= size:
        return {" ".join(words)}
    return {" ".join(words[i:i + size]) for i in range(len(words) - size + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def exact_groups(tasks: Sequence[EnvTask]) -> list[list[EnvTask]]:
    """Groups (of 2 or more) of tasks with the same normalised prompt, in task order."""
    groups: dict[str, list[EnvTask]] = defaultdict(list)
    for task in tasks:
        groups[normalise(task.prompt)].append(task)
    return [g for g in groups.values() if len(g) > 1]


def _candidates_exact(sets: Sequence[set[str]], threshold: float) -> list[tuple[int, int]]:
    """Every pair whose sizes allow the threshold (|A|/|B| >= t is necessary for J >= t)."""
    order = sorted(range(len(sets)), key=lambda i: len(sets[i]))
    out = []
    for x, i in enumerate(order):
        for j in order[x + 1:]:
            if len(sets[i]) < threshold * len(sets[j]):
                break
            out.append((min(i, j), max(i, j)))
    return out


def _candidates_lsh(sets: Sequence[set[str]], threshold: float) -> list[tuple[int, int]]:
    from datasketch import MinHash, MinHashLSH  # imports scipy: only worth it for big sets

    lsh = MinHashLSH(threshold=max(0.05, threshold - 0.1), num_perm=NUM_PERM)
    hashes = []
    for i, items in enumerate(sets):
        mh = MinHash(num_perm=NUM_PERM, seed=1)
        mh.update_batch([s.encode() for s in items])
        lsh.insert(str(i), mh)
        hashes.append(mh)
    found: set[tuple[int, int]] = set()
    for i, mh in enumerate(hashes):
        found.update((min(i, int(k)), max(i, int(k))) for k in lsh.query(mh) if int(k) != i)
    return sorted(found)


def near_pairs(
    tasks: Sequence[EnvTask], threshold: float, exact_limit: int = EXACT_LIMIT
) -> list[tuple[EnvTask, EnvTask, float]]:
    """Pairs of distinct-prompt tasks whose shingle Jaccard is >= threshold. Up to
    `exact_limit` tasks every pair is compared; above it MinHash LSH proposes candidates."""
    sets = [shingles(t.prompt) for t in tasks]
    candidates = (_candidates_exact(sets, threshold) if len(tasks) <= exact_limit
                  else _candidates_lsh(sets, threshold))
    pairs: list[tuple[EnvTask, EnvTask, float]] = []
    for i, j in candidates:
        if normalise(tasks[i].prompt) == normalise(tasks[j].prompt):
            continue  # exact duplicates are reported by exact_groups
        sim = jaccard(sets[i], sets[j])
        if sim >= threshold:
            pairs.append((tasks[i], tasks[j], round(sim, 4)))
    return sorted(pairs, key=lambda p: (p[0].id, p[1].id))
