"""Duplicate removal and diversity: exact by normalised text, near by MinHash LSH, distinct-n.

Near duplicates: each text becomes the set of its word n-gram shingles; datasketch's MinHash
(signatures for all texts at once with `MinHash.bulk`) and MinHashLSH propose candidate pairs whose
Jaccard similarity is probably above the threshold, and the MinHash estimate confirms them. Texts
are taken in order and the first of a near-duplicate group is kept, so the outcome is reproducible.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\w+|[^\w\s]+")


def tokens(text: str) -> list[str]:
    """Lower-cased words and runs of punctuation/operators (`3*x` is three tokens)."""
    return _TOKEN.findall(text.lower())


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def exact_duplicates(texts: Sequence[str]) -> dict[int, int]:
    """{index of a duplicate: index of the first text it repeats}, by normalised text."""
    first: dict[bytes, int] = {}
    dups: dict[int, int] = {}
    for i, text in enumerate(texts):
        key = hashlib.blake2b(normalise(text).encode(), digest_size=16).digest()
        if key in first:
            dups[i] = first[key]
        else:
            first[key] = i
    return dups


def shingles(text: str, n: int) -> set[bytes]:
    words = tokens(text)
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


def signatures(sets: Sequence[set[bytes]], num_perm: int = 128, seed: int = 1,
               chunk: int = 4096) -> tuple[Any, Any]:
    """MinHash signatures of many sets at once: the values `datasketch.MinHash.bulk` computes
    (its default affine32 scheme: sha1_hash32, fmix32, h -> a*h + b mod 2**32, same seed), with
    the per-shingle work vectorised over all sets instead of one numpy call per set."""
    import numpy as np
    from datasketch import MinHash
    from datasketch.minhash import _fmix

    permutations = MinHash(num_perm=num_perm, seed=seed).permutations
    a, b = permutations
    out = np.empty((len(sets), num_perm), dtype=np.uint32)
    for start in range(0, len(sets), chunk):
        part = [sorted(s) or [b""] for s in sets[start:start + chunk]]
        lengths = np.fromiter((len(p) for p in part), dtype=np.int64, count=len(part))
        hashed = np.fromiter(
            (struct.unpack_from("<I", hashlib.sha1(x).digest())[0] for p in part for x in p),
            dtype=np.uint32, count=int(lengths.sum()))
        mixed = _fmix(hashed.reshape(1, -1), 32)
        # (num_perm, shingles): uint32 arithmetic wraps (mod 2**32); reducing along the
        # contiguous axis is the faster layout for reduceat
        permuted = a.reshape(-1, 1) * mixed + b.reshape(-1, 1)
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out[start:start + len(part)] = np.minimum.reduceat(permuted, offsets, axis=1).T
    return out, permutations


@dataclass(frozen=True)
class NearDuplicate:
    index: int
    of: int
    similarity: float


def near_duplicates(
    texts: Sequence[str], *, threshold: float = 0.8, num_perm: int = 128, shingle: int = 3,
    skip: frozenset[int] | set[int] = frozenset(),
) -> list[NearDuplicate]:
    """Texts whose estimated Jaccard similarity to an earlier kept text reaches `threshold`.

    Indices in `skip` (already removed) are neither checked nor indexed."""
    from datasketch import MinHash, MinHashLSH

    order = [i for i in range(len(texts)) if i not in skip]
    values, permutations = signatures([shingles(texts[i], shingle) for i in order], num_perm)
    signatures_ = [MinHash(hashvalues=row, permutations=permutations, scheme="affine32")
                   for row in values]
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    found: list[NearDuplicate] = []
    by_index = dict(zip(order, signatures_, strict=True))
    for i in order:
        sig = by_index[i]
        best: tuple[float, int] | None = None
        for j in lsh.query(sig):
            sim = sig.jaccard(by_index[j])
            if sim >= threshold and (best is None or sim > best[0]):
                best = (sim, j)
        if best is not None:
            found.append(NearDuplicate(i, best[1], round(best[0], 4)))
        else:
            lsh.insert(i, sig, check_duplication=False)
    return found


def distinct_n(texts: Sequence[str], ns: Sequence[int] = (1, 2, 3)) -> dict[str, float]:
    """distinct-n (Li et al., 2016): unique n-grams over all n-grams of the texts, per n."""
    out: dict[str, float] = {}
    split = [tokens(t) for t in texts]
    for n in ns:
        seen: set[tuple[str, ...]] = set()
        total = 0
        for words in split:
            for i in range(len(words) - n + 1):
                seen.add(tuple(words[i:i + n]))
                total += 1
        out[f"distinct_{n}"] = round(len(seen) / total, 4) if total else 0.0
    return out
