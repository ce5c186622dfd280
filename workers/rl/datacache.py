"""Task records from the object store through three tiers: memory LRU, local disk, store.

Records live in JSONL shards listed by a manifest (`write_shards`), or in one JSONL object such
as a dataset version. `RecordStream` walks a seeded, shard-major order (shards shuffled per
epoch, records shuffled within a shard) so that a stream position maps to one record on every
rank and after a resume, and so that the shards a consumer will need next are known: they are
fetched by background threads while the trainer works on the current ones.

Integrity: a manifest carries each shard's SHA-256 (a dataset version's file name is its
digest); a shard whose bytes do not match is refused, never cached. Disk entries carry their
own digest and are re-checked on every read, so a damaged cache file is dropped and fetched
again instead of feeding the trainer garbage.

Metrics (`DataCache.stats` / `window`): requests served by each tier, the time the consumer
spent blocked on data, bytes read from the store, evictions, corrupt disk entries.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import random
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from workers.rl.objectives.base import Example
from workers.rl.spec_data import DataCacheSpec
from workers.storage import ObjectStore

MANIFEST_FORMAT = "crucible.shards/1"
TIERS = ("memory", "inflight", "disk", "store")  # where a consumer request was served from
_DIGEST_NAME = re.compile(r"([0-9a-f]{64})\.jsonl$")


class DataError(RuntimeError):
    """Records could not be read; the message names the object."""


class ObjectMissing(DataError):
    pass


class ObjectCorrupt(DataError):
    pass


class DataWaitTimeout(DataError):
    pass


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_jsonl(data: bytes, uri: str = "<bytes>") -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ObjectCorrupt(f"line {number} of {uri} is not valid JSON: {exc}") from None
        if not isinstance(rec, dict):
            raise ObjectCorrupt(f"line {number} of {uri} is not a JSON object")
        out.append(rec)
    return out


# ---- manifests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    uri: str
    records: int | None  # None until read (a bare JSONL source)
    sha256: str | None
    bytes: int | None = None


@dataclass(frozen=True)
class Manifest:
    shards: tuple[Shard, ...]

    @property
    def records(self) -> int:
        return sum(s.records or 0 for s in self.shards)


def write_shards(
    store: ObjectStore, prefix: str, records: Iterable[dict[str, Any]], shard_records: int = 1000
) -> str:
    """Write records as JSONL shards plus a manifest; returns the manifest's URI.

    Shards are written first and the manifest last, so a reader never sees a manifest that
    points at a shard that is not there yet.
    """
    if shard_records < 1:
        raise ValueError("shard_records must be >= 1")
    shards: list[dict[str, Any]] = []
    buf: list[bytes] = []

    def flush() -> None:
        data = b"".join(buf)
        uri = store.put_bytes(f"{prefix}/shard-{len(shards):06d}.jsonl", data)
        shards.append({"uri": uri, "records": len(buf), "sha256": sha256(data),
                       "bytes": len(data)})
        buf.clear()

    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"record {i} is not a JSON object")
        buf.append(json.dumps(rec, sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False).encode() + b"\n")
        if len(buf) == shard_records:
            flush()
    if buf:
        flush()
    if not shards:
        raise ValueError("no records to write")
    body = {"format": MANIFEST_FORMAT, "records": sum(s["records"] for s in shards),
            "shards": shards}
    return store.put_bytes(f"{prefix}/manifest.json", json.dumps(body, indent=1).encode())


def parse_manifest(data: bytes, uri: str) -> Manifest:
    try:
        body = json.loads(data)
        if body.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {body.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        shards = tuple(Shard(s["uri"], int(s["records"]), s.get("sha256"), s.get("bytes"))
                       for s in body["shards"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ObjectCorrupt(f"{uri} is not a valid shard manifest: {exc}") from None
    if not shards:
        raise ObjectCorrupt(f"manifest {uri} lists no shards")
    return Manifest(shards)


# ---- the cache ---------------------------------------------------------------------------


class DataCache:
    """Thread-safe; `get` is for the consumer, `prefetch` queues background fetches.

    Memory holds decoded values (sized by their encoded bytes); disk holds raw bytes under
    `<disk_dir>/<sha256(uri)>` with a `.json` sidecar (uri, digest, size). Disk eviction is
    least-recently-used by file mtime, so several cache instances (ranks, restarted runs) can
    share one folder and its order.
    """

    def __init__(
        self,
        store: ObjectStore,
        spec: DataCacheSpec,
        decode: Callable[[bytes, str], Any] = parse_jsonl,
    ) -> None:
        self.store, self.spec, self.decode = store, spec, decode
        self._mem: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._mem_bytes = 0
        self._mem_budget = int(spec.memory_mb * 2**20)
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(spec.workers, thread_name_prefix="datacache")
        self.counters: dict[str, float] = dict.fromkeys(
            [*(f"hits_{t}" for t in TIERS), "requests", "wait_s", "store_bytes", "prefetched",
             "evictions_memory", "evictions_disk", "corrupt_disk"], 0.0)
        self._window = dict(self.counters)
        self.disk: Path | None = None
        self._disk_index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._disk_budget = int(spec.disk_mb * 2**20)
        if spec.disk_dir is not None:
            self.disk = Path(spec.disk_dir)
            self.disk.mkdir(parents=True, exist_ok=True)
            self._scan_disk()

    # ---- public --------------------------------------------------------------------------

    def get(self, uri: str, sha: str | None = None) -> Any:
        """The decoded object; blocks until it is available. Raises DataError subclasses."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                self.counters["requests"] += 1
                if uri in self._mem:
                    self._mem.move_to_end(uri)
                    self.counters["hits_memory"] += 1
                    return self._mem[uri][0]
                fut = self._inflight.get(uri)
                if fut is None:
                    fut = self._inflight[uri] = Future()
                    mine = True
                else:
                    self.counters["hits_inflight"] += 1
                    mine = False
            if mine:
                value, tier = self._fill(uri, sha, fut)
                with self._lock:
                    self.counters[f"hits_{tier}"] += 1
                return value
            try:
                return fut.result(timeout=self.spec.wait_timeout_s)[0]
            except FutureTimeout:
                raise DataWaitTimeout(f"waited {self.spec.wait_timeout_s:.0f} s for {uri}; the "
                                      "object store is not answering") from None
        finally:
            with self._lock:
                self.counters["wait_s"] += time.perf_counter() - t0

    def prefetch(self, items: Iterable[tuple[str, str | None]]) -> None:
        """Fetch these (uri, sha256) in the background unless cached or already on the way.
        Errors are kept for the consumer: `get` raises them when it asks for that object."""
        for uri, sha in items:
            with self._lock:
                if uri in self._mem or uri in self._inflight:
                    continue
                fut = self._inflight[uri] = Future()
                self.counters["prefetched"] += 1
            self._pool.submit(self._fill_quietly, uri, sha, fut)

    def contains(self, uri: str) -> str | None:
        """Which tier holds `uri` now ("memory", "disk") or None; for tests and debugging."""
        with self._lock:
            if uri in self._mem:
                return "memory"
            if self.disk is not None and self._key(uri) in self._disk_index:
                return "disk"
        return None

    def stats(self) -> dict[str, float]:
        """Cumulative: hit rate per tier (share of consumer requests), waits, bytes."""
        with self._lock:
            return self._rates(dict(self.counters))

    def window(self) -> dict[str, float]:
        """Like `stats` but since the previous `window` call: one trainer step's view."""
        with self._lock:
            now = dict(self.counters)
            delta = {k: now[k] - self._window[k] for k in now}
            self._window = now
        return self._rates(delta)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> DataCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- tiers ---------------------------------------------------------------------------

    @staticmethod
    def _rates(c: dict[str, float]) -> dict[str, float]:
        n = c["requests"]
        out = {f"data/hit_rate_{t}": (c[f"hits_{t}"] / n if n else 0.0) for t in TIERS}
        out.update({"data/requests": n, "data/wait_s": c["wait_s"],
                    "data/store_mb": c["store_bytes"] / 2**20, "data/prefetched": c["prefetched"],
                    "data/evictions_memory": c["evictions_memory"],
                    "data/evictions_disk": c["evictions_disk"],
                    "data/corrupt_disk": c["corrupt_disk"]})
        return out

    def _fill_quietly(self, uri: str, sha: str | None, fut: Future) -> None:
        with contextlib.suppress(DataError):  # it is on the future, for the consumer
            self._fill(uri, sha, fut)

    def _fill(self, uri: str, sha: str | None, fut: Future) -> tuple[Any, str]:
        """Disk, then store; decodes, promotes to memory, settles the in-flight future."""
        try:
            data, tier = self._disk_read(uri, sha), "disk"
            if data is None:
                data, tier = self._store_read(uri, sha), "store"
            value = self.decode(data, uri)
            if tier == "store":
                self._disk_write(uri, data)
        except Exception as exc:
            err = exc if isinstance(exc, DataError) else DataError(
                f"reading {uri} failed: {type(exc).__name__}: {exc}")
            self._settle_failed(uri, fut, err)
            if err is exc:
                raise
            raise err from exc
        except BaseException as exc:  # interrupted: waiters must not hang
            self._settle_failed(uri, fut, DataError(f"reading {uri} was interrupted"))
            raise exc
        with self._lock:
            self._mem_put(uri, value, len(data))
            self._inflight.pop(uri, None)
        fut.set_result((value, tier))
        return value, tier

    def _settle_failed(self, uri: str, fut: Future, err: DataError) -> None:
        with self._lock:
            self._inflight.pop(uri, None)
        fut.set_exception(err)

    def _mem_put(self, uri: str, value: Any, size: int) -> None:
        if size > self._mem_budget:
            return  # bigger than the whole tier: serve it, keep it on disk only
        if uri in self._mem:
            self._mem_bytes -= self._mem.pop(uri)[1]
        while self._mem and self._mem_bytes + size > self._mem_budget:
            _, (_, old) = self._mem.popitem(last=False)
            self._mem_bytes -= old
            self.counters["evictions_memory"] += 1
        self._mem[uri] = (value, size)
        self._mem_bytes += size

    def _store_read(self, uri: str, sha: str | None) -> bytes:
        last: Exception | None = None
        for attempt in range(self.spec.retries + 1):
            try:
                data = self.store.get_bytes(uri)
                break
            except Exception as exc:  # noqa: BLE001 - classified below
                if _is_missing(exc):
                    raise ObjectMissing(f"{uri} does not exist in the object store") from None
                if isinstance(exc, ValueError):  # a URI outside the store: not transient
                    raise DataError(str(exc)) from None
                last = exc
                time.sleep(min(2.0, 0.1 * 2**attempt))
        else:
            raise DataError(f"reading {uri} failed after {self.spec.retries + 1} attempts: "
                            f"{type(last).__name__}: {last}") from last
        with self._lock:
            self.counters["store_bytes"] += len(data)
        expected = sha or _digest_from_name(uri)
        if expected is not None and sha256(data) != expected:
            raise ObjectCorrupt(f"{uri} is corrupt: its SHA-256 is {sha256(data)}, the manifest "
                                f"says {expected}")
        return data

    # disk tier: <key> holds bytes, <key>.json holds {"uri", "sha256", "bytes"}

    @staticmethod
    def _key(uri: str) -> str:
        return sha256(uri.encode())

    def _scan_disk(self) -> None:
        assert self.disk is not None
        found = []
        for meta in self.disk.glob("*.json"):
            body = meta.with_suffix("")
            try:
                found.append((body.stat().st_mtime, body.name, body.stat().st_size))
            except FileNotFoundError:
                meta.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._disk_index[key] = size

    def _disk_read(self, uri: str, sha: str | None) -> bytes | None:
        if self.disk is None:
            return None
        key = self._key(uri)
        body, meta = self.disk / key, self.disk / f"{key}.json"
        try:
            info = json.loads(meta.read_text())
            data = body.read_bytes()
        except (FileNotFoundError, json.JSONDecodeError):
            with self._lock:
                self._disk_index.pop(key, None)
            return None
        if info.get("uri") != uri or sha256(data) != info.get("sha256") or (
                sha is not None and sha != info.get("sha256")):
            self._disk_drop(key)
            with self._lock:
                self.counters["corrupt_disk"] += 1
            return None
        os.utime(body)  # most recently used, for every instance sharing the folder
        with self._lock:
            self._disk_index[key] = len(data)
            self._disk_index.move_to_end(key)
        return data

    def _disk_write(self, uri: str, data: bytes) -> None:
        if self.disk is None or len(data) > self._disk_budget:
            return
        key = self._key(uri)
        with self._lock:
            self._disk_index.pop(key, None)
            victims = []
            used = sum(self._disk_index.values())
            while self._disk_index and used + len(data) > self._disk_budget:
                old, size = self._disk_index.popitem(last=False)
                used -= size
                victims.append(old)
            self._disk_index[key] = len(data)
            self.counters["evictions_disk"] += len(victims)
        for old in victims:
            self._disk_drop(old, index=False)
        _atomic_write(self.disk / key, data)
        _atomic_write(self.disk / f"{key}.json", json.dumps(
            {"uri": uri, "sha256": sha256(data), "bytes": len(data)}).encode())

    def _disk_drop(self, key: str, index: bool = True) -> None:
        assert self.disk is not None
        (self.disk / f"{key}.json").unlink(missing_ok=True)  # sidecar first: never half-valid
        (self.disk / key).unlink(missing_ok=True)
        if index:
            with self._lock:
                self._disk_index.pop(key, None)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_missing(exc: Exception) -> bool:
    if isinstance(exc, FileNotFoundError):
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    code = (response or {}).get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("NoSuchKey", "404", "NotFound")


def _digest_from_name(uri: str) -> str | None:
    """Dataset versions are stored as `<sha256 of the bytes>.jsonl`: a free integrity check."""
    m = _DIGEST_NAME.search(uri)
    return m.group(1) if m else None


# ---- the consumer's view -----------------------------------------------------------------


class RecordStream:
    """An endless, seeded, shard-major order over all records; position -> record.

    Position p falls in epoch p // N. Each epoch visits the shards in a shuffled order and each
    shard's records in a shuffled order, so a consumer touches one shard at a time (the cache
    works on shards) and the next shards are known in advance (they are prefetched).
    """

    def __init__(self, cache: DataCache, source: str) -> None:
        self.cache, self.source = cache, source
        self.manifest = self._load_manifest(source)
        self._starts = [0]  # global index of each shard's first record
        for s in self.manifest.shards:
            self._starts.append(self._starts[-1] + (s.records or 0))
        self.size = self._starts[-1]
        if self.size == 0:
            raise DataError(f"{source} holds no records")
        self._orders: dict[int, list[int]] = {}  # epoch -> shard order (a few kept)
        self._within: dict[tuple[int, int], list[int]] = {}  # (epoch, shard) -> record order

    def _load_manifest(self, source: str) -> Manifest:
        if source.endswith(".jsonl"):  # one JSONL object: a one-shard dataset
            records = self.cache.get(source)
            return Manifest((Shard(source, len(records), _digest_from_name(source)),))
        try:
            data = self.cache.store.get_bytes(source)
        except Exception as exc:  # noqa: BLE001
            if _is_missing(exc):
                raise ObjectMissing(f"manifest {source} does not exist in the object store"
                                    ) from None
            raise DataError(f"reading manifest {source} failed: {exc}") from exc
        return parse_manifest(data, source)

    def __len__(self) -> int:
        return self.size

    # ---- the order ---------------------------------------------------------------------------

    def shard_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.manifest.shards)))
            random.Random(f"{self.cache.spec.seed}:shards:{epoch}").shuffle(order)
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return self._orders[epoch]

    def _record_order(self, epoch: int, shard: int) -> list[int]:
        key = (epoch, shard)
        if key not in self._within:
            within = list(range(self.manifest.shards[shard].records or 0))
            random.Random(f"{self.cache.spec.seed}:records:{epoch}:{shard}").shuffle(within)
            if len(self._within) >= 64:
                self._within.pop(next(iter(self._within)))
            self._within[key] = within
        return self._within[key]

    def epoch_order(self, epoch: int) -> list[int]:
        """Global record indices (shard start + index within) in epoch `epoch`'s visiting order:
        `epoch_order(e)[k]` is the record at stream position e * N + k."""
        out: list[int] = []
        for shard in self.shard_order(epoch):
            start = self._starts[shard]
            out += [start + i for i in self._record_order(epoch, shard)]
        return out

    def locate(self, position: int) -> tuple[int, int]:
        """(shard index, record index within it) of a stream position."""
        if position < 0:
            raise ValueError("stream positions start at 0")
        epoch, offset = divmod(position, self.size)
        order = self.shard_order(epoch)
        ends = list(_cumsum([self.manifest.shards[s].records or 0 for s in order]))
        slot = bisect.bisect_right(ends, offset)
        start = ends[slot - 1] if slot else 0
        return order[slot], self._record_order(epoch, order[slot])[offset - start]

    def _after(self, epoch: int, shard: int, count: int) -> list[int]:
        """The `count` shards visited after `shard` in epoch `epoch` (running into the next)."""
        order = self.shard_order(epoch)
        slot = order.index(shard)
        out: list[int] = []
        while len(out) < min(count, len(order)):
            slot += 1
            if slot >= len(order):
                epoch, slot = epoch + 1, 0
                order = self.shard_order(epoch)
            if order[slot] not in out:
                out.append(order[slot])
        return out

    def _prefetch_after(self, epoch: int, shard: int) -> None:
        shards = self.manifest.shards
        self.cache.prefetch((shards[s].uri, shards[s].sha256)
                            for s in self._after(epoch, shard, self.cache.spec.prefetch_shards))

    def _shard_records(self, shard: int) -> list[dict[str, Any]]:
        s = self.manifest.shards[shard]
        recs = self.cache.get(s.uri, s.sha256)
        if len(recs) != (s.records or 0):
            raise ObjectCorrupt(f"{s.uri} has {len(recs)} records; the manifest says {s.records}")
        return recs

    # ---- reading -----------------------------------------------------------------------------

    def records(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        """The records at these stream positions; prefetches the shards that come next."""
        if not positions:
            return []
        located = [self.locate(p) for p in positions]
        last = max(positions)
        self._prefetch_after(last // self.size, self.locate(last)[0])
        loaded: dict[int, list[dict[str, Any]]] = {}  # one cache request per shard per call
        out = []
        for shard, idx in located:
            if shard not in loaded:
                loaded[shard] = self._shard_records(shard)
            out.append(loaded[shard][idx])
        return out

    def record_at(self, index: int, epoch: int) -> dict[str, Any]:
        """Record number `index` (global, unshuffled), prefetching what follows its shard in
        epoch `epoch`'s order."""
        if not 0 <= index < self.size:
            raise IndexError(f"record {index} of {self.size}")
        shard = bisect.bisect_right(self._starts, index) - 1
        self._prefetch_after(epoch, shard)
        return self._shard_records(shard)[index - self._starts[shard]]


def _cumsum(sizes: list[int]) -> Iterable[int]:
    total = 0
    for n in sizes:
        total += n
        yield total


class RecordExamples(Sequence[Example]):
    """Task records as the trainer's `Objective.train`, read through the cache.

    Give `order` to `TaskSampler` as its `permutation`: it is the stream's shard-major epoch
    order, so the sampler walks one shard at a time and the shards after the current one are
    prefetched while the step trains.
    """

    def __init__(self, stream: RecordStream, prompt_field: str = "prompt",
                 reference_field: str = "reference") -> None:
        self.stream, self.prompt_field, self.reference_field = stream, prompt_field, \
            reference_field
        self._epoch = 0

    def __len__(self) -> int:
        return self.stream.size

    def order(self, epoch: int, n: int) -> list[int]:
        if n != self.stream.size:
            raise ValueError(f"asked to order {n} records; the source holds {self.stream.size}")
        self._epoch = epoch
        return self.stream.epoch_order(epoch)

    @overload
    def __getitem__(self, index: int) -> Example: ...
    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...

    def __getitem__(self, index: int | slice) -> Example | list[Example]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        rec = self.stream.record_at(index, self._epoch)
        uri = self.stream.source
        meta = {k: v for k, v in rec.items()
                if k not in (self.prompt_field, self.reference_field) and isinstance(v, str)}
        return Example(prompt=record_text(rec, self.prompt_field, uri),
                       reference=record_text(rec, self.reference_field, uri), meta=meta)


def record_text(record: dict[str, Any], field: str, uri: str) -> str:
    """A required string field of a task record, with an error naming it."""
    value = record.get(field)
    if not isinstance(value, str):
        raise DataError(f"a record in {uri} has no string field {field!r} (fields: "
                        f"{sorted(record)})")
    return value


# ---- an objective whose training prompts come from the store ------------------------------


@dataclass
class RecordObjective:
    """The trainer's `Objective` with `train` read from object-store records through the cache.

    The eval split and the reward stay the base objective's: records bring prompts and
    reference completions, the objective knows how to score them. The tokenizer corpus is the
    base corpus plus every record's text (read once, through the cache, when a tokenizer is
    trained).
    """

    base: Any  # the built-in objective (workers.rl.objectives.Objective)
    train: RecordExamples

    @property
    def eval(self) -> Sequence[Example]:
        return self.base.eval

    @property
    def reward(self) -> Any:
        return self.base.reward

    def corpus(self) -> list[str]:
        texts = list(self.base.corpus())
        for i in range(len(self.train)):
            example = self.train[i]
            texts.append(example.prompt + example.reference)
        return texts


def records_objective(
    base: Any, spec: DataCacheSpec, store: ObjectStore
) -> tuple[DataCache, RecordObjective]:
    """The cache and the objective for a run whose `data.source` is set (the caller closes the
    cache)."""
    if spec.source is None:
        raise ValueError("data.source is not set")
    cache = DataCache(store, spec)
    try:
        stream = RecordStream(cache, spec.source)
    except BaseException:
        cache.close()
        raise
    examples = RecordExamples(stream, spec.prompt_field, spec.reference_field)
    return cache, RecordObjective(base, examples)
