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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.rl.weight_layout import (  # noqa: F401 - this module's users import them here
    BUCKET_BYTES,
    Layout,
    Slot,
    empty_buckets,
    flatten,
    layout_of,
    unflatten,
)


class WeightPushTimeout(TimeoutError):
    """A push did not complete in time (the actor is hung, dead or unreachable). Retryable:
    a new attempt places a new actor."""

    retryable = True


class WeightMismatch(RuntimeError):
    """The actor holds other bytes than the learner sent: a broken transport, never retried."""

    retryable = False


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
