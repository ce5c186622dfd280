"""A state dict as a few flat buffers, one dtype each, and where each tensor sits in them: the
layout both ends of a weight hand-off agree on (pure data, computed once from the first
snapshot). Used by the rollout process's shared memory (`workers.rl.process_actor`) and the Ray
rollout actors' weight pushes (`workers.cluster.weights`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKET_BYTES = 64 * 1024 * 1024  # per collective: large enough to amortise, small to pipeline


@dataclass(frozen=True)
class Slot:
    """Where one tensor of the state dict sits: bucket ``bucket`` from element ``offset``."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    """The state dict's tensors in buckets: one dtype per bucket, at most ``bucket_bytes`` each
    (a single larger tensor gets a bucket of its own)."""

    slots: tuple[Slot, ...]
    buckets: tuple[tuple[str, int], ...]  # per bucket: dtype name, element count

    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for d, n in self.buckets)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """The layout of ``state``: tensors grouped by dtype (a bucket is one flat tensor), each
    group in name order, packed into buckets of at most ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be positive")
    if not state:
        raise ValueError("an empty state dict has no weights to push")
    slots: list[Slot] = []
    buckets: list[tuple[str, int]] = []
    by_dtype: dict[str, list[str]] = {}
    for name in sorted(state):
        by_dtype.setdefault(_name(state[name].dtype), []).append(name)
    for dtype in sorted(by_dtype):
        size = _dtype(dtype).itemsize
        fill = None  # (bucket index, elements so far) of the open bucket
        for name in by_dtype[dtype]:
            n = state[name].numel()
            if fill is None or (fill[1] + n) * size > bucket_bytes and fill[1] > 0:
                if fill is not None:
                    buckets.append((dtype, fill[1]))
                fill = (len(buckets), 0)
            slots.append(Slot(name, tuple(state[name].shape), dtype, fill[0], fill[1]))
            fill = (fill[0], fill[1] + n)
        if fill is not None:
            buckets.append((dtype, fill[1]))
    return Layout(tuple(slots), tuple(buckets))


def empty_buckets(layout: Layout, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Fresh buckets to receive into."""
    return [torch.empty(n, dtype=_dtype(d), device=device) for d, n in layout.buckets]


def flatten(state: dict[str, torch.Tensor], layout: Layout,
            device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The state dict copied into its layout's buckets; refuses a state of another shape."""
    check(state, layout)
    out = empty_buckets(layout, device)
    for s in layout.slots:
        out[s.bucket][s.offset:s.offset + s.numel].copy_(state[s.name].reshape(-1))
    return out


def check(state: dict[str, torch.Tensor], layout: Layout) -> None:
    """ValueError unless `state` has exactly the layout's names, shapes and dtypes."""
    if set(state) != {s.name for s in layout.slots}:
        missing = sorted({s.name for s in layout.slots} - set(state))
        extra = sorted(set(state) - {s.name for s in layout.slots})
        raise ValueError(f"the state dict does not match the layout: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for s in layout.slots:
        t = state[s.name]
        if tuple(t.shape) != s.shape or _name(t.dtype) != s.dtype:
            raise ValueError(f"{s.name}: {tuple(t.shape)} {_name(t.dtype)} where the layout "
                             f"has {s.shape} {s.dtype}")


def unflatten(buckets: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The state dict as views into ``buckets`` (no copy)."""
    if [(_name(b.dtype), b.numel()) for b in buckets] != list(layout.buckets):
        raise ValueError("the buckets do not match the layout")
    return {s.name: buckets[s.bucket][s.offset:s.offset + s.numel].view(s.shape)
            for s in layout.slots}
