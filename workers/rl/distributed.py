"""torch.distributed setup: gloo on CPU, NCCL on GPU; a plain process is a world of one."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEVICE_ENV = "CRUCIBLE_DEVICE"
TIMEOUT_ENV = "CRUCIBLE_DIST_TIMEOUT_S"


def collective_timeout() -> timedelta | None:
    """How long a collective may wait for a missing peer before it raises
    (``CRUCIBLE_DIST_TIMEOUT_S``; unset: torch's default). A launcher whose ranks live on
    several hosts sets it, so a rank that died on a lost node fails the others' next collective
    instead of hanging them."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    seconds = float(raw)
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, not {raw!r}")
    return timedelta(seconds=seconds)


def on_cuda() -> bool:
    """Whether this process trains on a GPU: when CUDA is visible, unless ``CRUCIBLE_DEVICE=cpu``
    asks for CPU ranks on gloo on a GPU host (the CPU tests on a GPU machine: more ranks than
    GPUs). ``CRUCIBLE_DEVICE=cuda`` makes a missing GPU an error instead of a silent CPU run."""
    choice = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be auto, cpu or cuda, not {choice!r}")
    if choice == "cpu":
        return False
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise RuntimeError(f"{DEVICE_ENV}=cuda but torch sees no CUDA device")
    return available


def quiet_libraries() -> None:
    """Progress bars and per-call INFO lines drown the run's own output."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@contextmanager
def process_group() -> Iterator[tuple[int, int]]:
    """Yield (rank, world). Joins torchrun's group when launched by it; otherwise makes a group
    of one (so the same engine code runs inside a Celery task). Tears the group down at exit:
    without that, a finished run sometimes aborts at interpreter exit."""
    cuda = on_cuda()
    if not cuda and torch.cuda.is_available():
        # CPU ranks on a GPU host: DeepSpeed would pick its CUDA accelerator and bind each rank
        # to a GPU of its local rank. Set before DeepSpeed is imported: it caches its choice.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    quiet_libraries()
    added = {}
    if "RANK" not in os.environ:
        added = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        os.environ.update(added)
    owned = not dist.is_initialized()
    try:
        if owned:
            backend = "nccl" if cuda else "gloo"
            if backend == "gloo":
                # DeepSpeed JIT-compiles a shared-memory op that serves only inference
                # all-reduce, which training never calls; the compile costs 30-90 s on a
                # fresh machine, so mark it unavailable (it then falls back to gloo).
                import deepspeed.ops

                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            if cuda:
                local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
                if local_rank >= gpus:
                    # NCCL needs a GPU per rank; say so before CUDA's "invalid device ordinal".
                    raise RuntimeError(
                        f"local rank {local_rank} has no GPU: this host shows {gpus} and runs "
                        f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} ranks; start at most {gpus} "
                        f"ranks per host, or set {DEVICE_ENV}=cpu to train on CPU (gloo)")
                torch.cuda.set_device(local_rank)
            timeout = collective_timeout()
            extra = {"timeout": timeout} if timeout is not None else {}
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **extra)
        yield dist.get_rank(), dist.get_world_size()
    finally:
        if owned and dist.is_initialized():
            # DeepSpeed's teardown also drops the groups it cached, so a later run in this
            # process (a Celery worker, a test session) starts from a clean slate.
            import deepspeed.comm as ds_comm

            ds_comm.destroy_process_group()
            ds_comm.comm.cdb = None
        for k in added:
            os.environ.pop(k, None)


def _all_reduce(values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        out = values.detach().to(device, copy=True)
        dist.all_reduce(out, op=op)
        return out.to(values.device)
    return values


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks (identity in a world of one)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max over ranks (identity in a world of one)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any: ranks must agree on skipping a step."""
    t = torch.tensor([1.0 if flag else 0.0])
    return bool(all_reduce_sum(t).item() > 0)


def from_rank0(value: int) -> int:
    """Rank 0's ``value`` on every rank (identity in a world of one): a decision only rank 0
    can make (it alone holds the run's reporter) that every rank must act on alike."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())
    return value
