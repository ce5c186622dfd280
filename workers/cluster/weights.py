"""Weights from a learner rank to its rollout actor: the state dict as a few flat buckets, sent
over a two-process ``torch.distributed`` group (the learner is rank 0, the actor rank 1) — gloo
on CPU, NCCL on GPU, the same code for both.

Why buckets: one collective per bucket instead of one per tensor (hundreds for a real model,
each paying a round trip), and one contiguous buffer per bucket that the receiver allocates
from the layout alone. Why a group of two and not the training group: the actor is no rank of
the training world; a standalone group (its own TCP store) is created without the training
ranks taking part, so a slow or dead actor can only time out its own push.

The layout (names, shapes, dtypes, where each tensor sits) is pure data: the learner computes
it once and hands it to the actor; both sides then agree on every byte's place. The checksum
(BLAKE2b over the buckets' bytes) lets a run prove the actor holds exactly the learner's
weights after a push. No Ray here: :mod:`workers.cluster.rollouts` carries the layout and the
rendezvous address between the two processes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024  # per collective: large enough to amortise, small to pipeline


class WeightPushTimeout(TimeoutError):
    """A push did not complete in time (the actor is hung, dead or unreachable). Retryable:
    a new attempt places a new actor."""

    retryable = True


class WeightMismatch(RuntimeError):
    """The actor holds other bytes than the learner sent: a broken transport, never retried."""

    retryable = False


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
    if set(state) != {s.name for s in layout.slots}:
        missing = sorted({s.name for s in layout.slots} - set(state))
        extra = sorted(set(state) - {s.name for s in layout.slots})
        raise ValueError(f"the state dict does not match the layout: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    out = empty_buckets(layout, device)
    for s in layout.slots:
        t = state[s.name]
        if tuple(t.shape) != s.shape or _name(t.dtype) != s.dtype:
            raise ValueError(f"{s.name}: {tuple(t.shape)} {_name(t.dtype)} where the layout "
                             f"has {s.shape} {s.dtype}")
        out[s.bucket][s.offset:s.offset + s.numel].copy_(t.reshape(-1))
    return out


def unflatten(buckets: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The state dict as views into ``buckets`` (no copy)."""
    if [(_name(b.dtype), b.numel()) for b in buckets] != list(layout.buckets):
        raise ValueError("the buckets do not match the layout")
    return {s.name: buckets[s.bucket][s.offset:s.offset + s.numel].view(s.shape)
            for s in layout.slots}


def checksum(buckets: list[torch.Tensor]) -> str:
    """BLAKE2b of the buckets' bytes, in order: equal iff the weights are bitwise equal."""
    h = hashlib.blake2b(digest_size=16)
    for b in buckets:
        flat = b.detach().reshape(-1).cpu().contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WeightChannel:
    """One end of a learner → actor group of two: ``send`` on the learner (rank 0), ``recv``
    on the actor (rank 1). Each bucket is one broadcast from rank 0; every wait is bounded by
    ``timeout_s``, so a peer that stops answering raises :class:`WeightPushTimeout`."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float,
                 device: torch.device | str = "cpu") -> None:
        self.rank, self.timeout = rank, timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0,
                              timeout=self.timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore("crucible-weights", store)
        self.store = store  # kept alive: the group talks through it
        self.group = self._group(prefixed)

    def _group(self, store: Any) -> Any:
        """gloo for CPU tensors; NCCL (GPU builds of torch only) for CUDA tensors."""
        if self.device.type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no NCCL: CUDA weight pushes need a "
                                   "CUDA build of torch")
            opts = nccl.Options()
            opts._timeout = self.timeout
            return nccl(store, self.rank, 2, opts)
        return dist.ProcessGroupGloo(store, self.rank, 2, self.timeout)

    def _broadcast(self, buckets: list[torch.Tensor], what: str) -> None:
        for i, b in enumerate(buckets):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            work = self.group.broadcast([b], opts)
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:  # gloo and NCCL raise RuntimeError on a timeout
                raise WeightPushTimeout(f"{what}: bucket {i + 1}/{len(buckets)} did not "
                                        f"complete within {self.timeout.total_seconds():.0f} "
                                        f"s ({str(exc).splitlines()[0][:200]})") from exc

    def send(self, buckets: list[torch.Tensor]) -> None:
        self._broadcast(buckets, "sending weights")

    def recv(self, layout: Layout) -> list[torch.Tensor]:
        buckets = empty_buckets(layout, self.device)
        self._broadcast(buckets, "receiving weights")
        return buckets
