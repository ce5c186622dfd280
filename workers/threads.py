"""How many compute threads a process may use, and setting torch, OpenMP and MKL to it.

Left at their defaults, torch, OpenMP and MKL each start a thread per core in every process: two
worker processes on a 2-core host run four spinning threads, and on a busy host SFT ran about
10x slower and the inference server's throughput swung 10x until `OMP_NUM_THREADS=1` was set by
hand. So every process that computes (each Celery worker process, `python -m workers.rl
train` and each of its torchrun ranks, `python -m workers.inference serve`) takes an allotment:

- `CRUCIBLE_THREADS`, when set: threads per process (the setting);
- else the usable cores (CPU affinity, capped by a cgroup CPU quota) divided by the processes
  sharing them (`CRUCIBLE_THREAD_SHARERS`, which a launcher sets: a Celery worker its pool's
  concurrency, torchrun its local world size; 1 for a lone process), at least 1.

`configure()` applies it: `OMP_NUM_THREADS`, `MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS` for this
process (read when those libraries load) and its children, and torch's intra-op threads when
torch is loaded already; it returns the allotment so the caller reports it at start. Pure
standard library until torch is already imported: engines and the Celery adapter may call it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SETTING = "CRUCIBLE_THREADS"
SHARERS = "CRUCIBLE_THREAD_SHARERS"
LIBRARY_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Allotment:
    threads: int  # per process
    cores: int  # usable by this process
    sharers: int  # processes sharing those cores
    source: str  # "CRUCIBLE_THREADS" or "cores / sharers"

    def describe(self) -> str:
        why = (f"{SETTING}={self.threads}" if self.source == SETTING else
               f"{self.cores} usable core(s) / {self.sharers} process(es) sharing them; "
               f"set {SETTING} to change it")
        return f"threads: {self.threads} per process for torch, OpenMP and MKL ({why})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs the cgroup may use (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), or
    None without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _positive(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {raw!r}")
    return value


def allotment(sharers: int | None = None, *, env: Mapping[str, str] | None = None,
              cores: int | None = None) -> Allotment:
    """This process's allotment. `sharers`: the processes sharing the cores, when the caller
    knows better than `CRUCIBLE_THREAD_SHARERS` (default 1)."""
    env = os.environ if env is None else env
    cores = cores if cores is not None else usable_cores()
    share = sharers if sharers is not None else (_positive(env, SHARERS) or 1)
    setting = _positive(env, SETTING)
    if setting is not None:
        return Allotment(setting, cores, share, SETTING)
    return Allotment(max(1, cores // max(1, share)), cores, share, "cores / sharers")


def apply(allot: Allotment) -> Allotment:
    for name in LIBRARY_VARS:
        os.environ[name] = str(allot.threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(allot.threads)
        # Allowed once, before any inter-op work; a later call keeps the first value.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(allot.threads)
    return allot


def configure(sharers: int | None = None, *, role: str = "process") -> Allotment:
    """Compute this process's allotment, apply it, and log it (the caller may also report it,
    e.g. as a run event). Raises ValueError naming a bad setting."""
    allot = apply(allotment(sharers))
    log.info("%s %d: %s", role, os.getpid(), allot.describe())
    return allot


def sharers(env: Mapping[str, str] | None = None) -> int:
    """The processes sharing this one's cores as its launcher said (`CRUCIBLE_THREAD_SHARERS`,
    1 when unset): a process that starts a helper beside itself doubles it for both."""
    return _positive(os.environ if env is None else env, SHARERS) or 1


def restore(saved: dict[str, Any]) -> None:
    """Undo a `configure` from what `in_use()` returned before it."""
    for name in LIBRARY_VARS:
        if saved.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved[name]
    torch = sys.modules.get("torch")
    if torch is not None and saved.get("torch_threads"):
        torch.set_num_threads(saved["torch_threads"])


def in_use() -> dict[str, Any]:
    """What this process actually runs with: torch's intra-op threads (when torch is loaded)
    and the library variables, for reports and tests."""
    torch = sys.modules.get("torch")
    out: dict[str, Any] = {name: os.environ.get(name) for name in LIBRARY_VARS}
    out["torch_threads"] = torch.get_num_threads() if torch is not None else None
    return out
