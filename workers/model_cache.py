"""Checkpoint objects unpacked on a worker host: streaming fetch and a pruned model cache.

A run that starts from an earlier run's checkpoint (training or evaluation) needs that
checkpoint as a local folder. Objects are streamed from the store straight into tarfile
(never held whole in memory or copied to a temporary tar first), unpacked beside the target
and renamed into place, so a folder is complete or absent.

Unpacked base models are kept in ``<var>/models`` for the next run on this host, within
``CRUCIBLE_MODEL_CACHE_GB`` (default 20): after each fetch, the least recently used entries
are removed until the cache fits. A run holds a shared ``flock`` on its entry's lock file for
as long as it uses the folder and pruning takes the lock exclusively without waiting, so an
entry in use by any process on the host is never removed (a lone entry larger than the budget
stays while it is in use). Lock files are never deleted: a process waiting on an unlinked
lock could otherwise use a folder that a later prune no longer sees as in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from workers.paths import var_dir
from workers.storage import ObjectStore

DEFAULT_CACHE_GB = 20.0


def fetch_tar(store: ObjectStore, uri: str, target: Path) -> Path:
    """Unpack the tar object ``uri`` into ``target`` (complete or absent: unpacked beside it,
    then renamed), streaming it from the store. Member paths are confined to ``target`` by
    tarfile's data filter."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        unpacked = tmp / "unpacked"
        with contextlib.closing(store.open_binary(uri)) as stream, \
                tarfile.open(fileobj=stream, mode="r|*") as tar:
            tar.extractall(unpacked, filter="data")
        try:
            os.replace(unpacked, target)
        except OSError:
            if not target.is_dir():  # not another process finishing the same fetch first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def pack_checkpoint(store: ObjectStore, path: Path, key: str, scratch: Path) -> str:
    """Pack a checkpoint into one tar object at ``key`` (the inverse of ``fetch_tar``). A
    periodic checkpoint (``step-N/hf``) brings its whole folder (DeepSpeed state, RNG,
    state.json: what a resume needs); the final export is a bare model folder, packed as
    ``hf/``."""
    periodic = path.name == "hf"
    folder = path.parent if periodic else path
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=scratch, suffix=".tar") as tmp:
        with tarfile.open(tmp.name, "w") as tar:
            if periodic:
                for child in sorted(folder.iterdir()):
                    tar.add(child, arcname=child.name)
            else:
                tar.add(folder, arcname="hf")
        return store.put_file(key, Path(tmp.name))


def cache_budget_bytes() -> int:
    raw = os.environ.get("CRUCIBLE_MODEL_CACHE_GB", "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_CACHE_GB
    except ValueError as exc:
        raise ValueError(f"CRUCIBLE_MODEL_CACHE_GB must be a number of GB, not {raw!r}") from exc
    if gb < 0:
        raise ValueError(f"CRUCIBLE_MODEL_CACHE_GB must be >= 0, not {raw!r}")
    return int(gb * 1024**3)


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class ModelCache:
    """``<root>/<key>`` folders with ``<root>/<key>.lock`` files whose mtime is the last use."""

    def __init__(self, root: Path, budget_bytes: int | None = None) -> None:
        self.root = root
        self.budget = cache_budget_bytes() if budget_bytes is None else budget_bytes

    @staticmethod
    def key(uri: str) -> str:
        return hashlib.sha256(uri.encode()).hexdigest()[:24]

    @contextlib.contextmanager
    def use(self, store: ObjectStore, uri: str) -> Iterator[Path]:
        """The unpacked folder of ``uri``, kept from pruning until the block exits."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.key(uri)
        fd = os.open(self.root / f"{key}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.utime(fd)  # last use, for least-recently-used pruning
            folder = fetch_tar(store, uri, self.root / key)
            self.prune()
            yield folder
        finally:
            os.close(fd)

    def prune(self) -> list[str]:
        """Remove least recently used entries not in use until the cache fits its budget;
        returns the removed keys."""
        entries = []
        for lock in self.root.glob("*.lock"):
            folder = lock.with_suffix("")
            if folder.is_dir():
                entries.append((lock.stat().st_mtime, folder, lock))
        sizes = {folder: folder_bytes(folder) for _, folder, _ in entries}
        total = sum(sizes.values())
        removed = []
        for _, folder, lock in sorted(entries, key=lambda e: e[0]):
            if total <= self.budget:
                break
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # in use by a run on this host
            try:
                # Renamed first, so no reader ever sees a half-deleted folder as complete.
                doomed = folder.with_name(f".del-{folder.name}-{os.getpid()}")
                os.replace(folder, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
            finally:
                os.close(fd)
            total -= sizes[folder]
            removed.append(folder.name)
        return removed


__all__ = ["ModelCache", "cache_budget_bytes", "fetch_tar", "folder_bytes"]


def cached_model(store: ObjectStore, uri: str, hold: contextlib.ExitStack) -> Path:
    """The Hugging Face folder (``hf/``) of the checkpoint object ``uri``, unpacked into this
    host's model cache (``<var>/models``) and kept from pruning until ``hold`` closes: how a
    train run's base model and an eval run's model are both brought onto a worker."""
    return hold.enter_context(ModelCache(var_dir() / "models").use(store, uri)) / "hf"
