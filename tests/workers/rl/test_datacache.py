"""The three-tier record cache (memory LRU, local disk, object store) over a real LocalStore and
a real S3-compatible server (moto), with background prefetch and integrity checks."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time

import pytest
from pydantic import ValidationError

from workers.rl.curriculum import TaskSampler
from workers.rl.datacache import (
    DataCache,
    DataError,
    ObjectCorrupt,
    ObjectMissing,
    RecordExamples,
    RecordStream,
    parse_manifest,
    write_shards,
)
from workers.rl.spec import CurriculumSpec
from workers.rl.spec_data import DataCacheSpec
from workers.storage import LocalStore, S3Store

MB = 2**20


def make_records(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "reference": str(i + 1), "id": i} for i in range(n)]


@pytest.fixture
def store(tmp_path):
    return LocalStore((tmp_path / "objects").as_uri())


@pytest.fixture
def dataset(store):
    """40 records in 4 shards of 10."""
    uri = write_shards(store, "ds", make_records(40), shard_records=10)
    return uri, parse_manifest(store.get_bytes(uri), uri)


def spec(tmp_path, **kw) -> DataCacheSpec:
    base = {"disk_dir": str(tmp_path / "cache"), "prefetch_shards": 0, "retries": 0}
    return DataCacheSpec(**{**base, **kw})


def test_memory_tier_evicts_the_least_recently_used(tmp_path, store, dataset):
    _, man = dataset
    a, b, c, _ = man.shards
    with DataCache(store, spec(tmp_path, disk_dir=None, memory_mb=2.5 * a.bytes / MB)) as cache:
        assert [r["id"] for r in cache.get(a.uri, a.sha256)] == list(range(10))
        cache.get(b.uri, b.sha256)
        cache.get(a.uri, a.sha256)  # a is now more recent than b
        cache.get(c.uri, c.sha256)  # over budget: b goes, not a
        assert [cache.contains(s.uri) for s in (a, b, c)] == ["memory", None, "memory"]
        st = cache.stats()
    assert st["data/requests"] == 4
    assert st["data/hit_rate_memory"] == 0.25 and st["data/hit_rate_store"] == 0.75
    assert st["data/evictions_memory"] == 1


def test_disk_tier_is_reused_by_a_new_cache_without_the_store(tmp_path, store, dataset):
    uri, man = dataset
    with DataCache(store, spec(tmp_path)) as first:
        stream = RecordStream(first, uri)
        seen = stream.records(range(40))
        assert first.stats()["data/hit_rate_store"] > 0
    assert sorted(r["id"] for r in seen) == list(range(40))  # one epoch = every record once
    for s in man.shards:  # the store loses the shards; only the manifest is left
        (store.root / "ds" / s.uri.rsplit("/", 1)[1]).unlink()
    with DataCache(store, spec(tmp_path)) as second:
        again = RecordStream(second, uri).records(range(40))
        st = second.stats()
    assert again == seen
    assert st["data/store_mb"] == 0.0
    assert st["data/hit_rate_store"] == 0.0 and st["data/hit_rate_disk"] > 0


def test_disk_tier_evicts_least_recently_used_across_instances(tmp_path, store, dataset):
    _, man = dataset
    a, b, c, _ = man.shards
    s = spec(tmp_path, disk_mb=2.5 * a.bytes / MB, memory_mb=0.5 * a.bytes / MB)
    with DataCache(store, s) as cache:
        for shard in (a, b, c):
            cache.get(shard.uri, shard.sha256)
        assert cache.stats()["data/evictions_disk"] == 1
    with DataCache(store, s) as cache:
        assert [cache.contains(x.uri) for x in (a, b, c)] == [None, "disk", "disk"]
        cache.get(b.uri, b.sha256)  # b becomes the most recent on disk
        cache.get(a.uri, a.sha256)  # from the store again; evicts c, the oldest
        assert [cache.contains(x.uri) for x in (a, b, c)] == ["disk", "disk", None]
        st = cache.stats()
    assert st["data/hit_rate_disk"] == 0.5 and st["data/hit_rate_store"] == 0.5


def test_a_damaged_disk_entry_is_dropped_and_fetched_again(tmp_path, store, dataset):
    _, man = dataset
    a = man.shards[0]
    with DataCache(store, spec(tmp_path)) as cache:
        good = cache.get(a.uri, a.sha256)
    key = hashlib.sha256(a.uri.encode()).hexdigest()
    (tmp_path / "cache" / key).write_bytes(b'{"id": 999}\n')
    with DataCache(store, spec(tmp_path)) as cache:
        assert cache.get(a.uri, a.sha256) == good
        st = cache.stats()
    assert st["data/corrupt_disk"] == 1 and st["data/hit_rate_store"] == 1.0


def test_a_corrupt_store_object_is_refused_and_never_cached(tmp_path, store, dataset):
    _, man = dataset
    b = man.shards[1]
    (store.root / "ds" / "shard-000001.jsonl").write_bytes(b'{"id": -1}\n')
    with DataCache(store, spec(tmp_path)) as cache:
        for _ in range(2):
            with pytest.raises(ObjectCorrupt, match=r"shard-000001\.jsonl is corrupt.*SHA-256"):
                cache.get(b.uri, b.sha256)
        assert cache.contains(b.uri) is None
    assert not any((tmp_path / "cache").iterdir())


def test_missing_objects_are_named_even_when_prefetched(tmp_path, store, dataset):
    uri, man = dataset
    (store.root / "ds" / "shard-000002.jsonl").unlink()
    with DataCache(store, spec(tmp_path, prefetch_shards=3)) as cache:
        stream = RecordStream(cache, uri)
        missing = man.shards[2].uri
        with pytest.raises(ObjectMissing, match=f"{missing} does not exist"):
            for step in range(4):
                stream.records(range(step * 10, step * 10 + 10))
    with pytest.raises(ObjectMissing, match="manifest .* does not exist"):
        RecordStream(DataCache(store, spec(tmp_path)), store.uri("nope/manifest.json"))


def test_single_jsonl_sources_and_dataset_version_digests(tmp_path, store):
    body = b"".join(json.dumps(r).encode() + b"\n" for r in make_records(5))
    digest = hashlib.sha256(body).hexdigest()
    good = store.put_bytes(f"datasets/{digest[:2]}/{digest}.jsonl", body)
    with DataCache(store, spec(tmp_path)) as cache:
        stream = RecordStream(cache, good)
        assert len(stream) == 5
        assert sorted(r["id"] for r in stream.records(range(5))) == list(range(5))
    tampered = store.put_bytes(f"datasets/00/{'0' * 64}.jsonl", body)
    broken = store.put_bytes("raw/broken.jsonl", b'{"a": 1}\nnot json\n')
    with DataCache(store, spec(tmp_path)) as cache:
        with pytest.raises(ObjectCorrupt, match="SHA-256"):
            RecordStream(cache, tampered)
        with pytest.raises(ObjectCorrupt, match="line 2 of .*broken.jsonl is not valid JSON"):
            RecordStream(cache, broken)
    not_manifest = store.put_bytes("raw/other.json", b'{"format": "x"}')
    with pytest.raises(ObjectCorrupt, match="not a valid shard manifest"):
        RecordStream(DataCache(store, spec(tmp_path)), not_manifest)


class RecordingStore(LocalStore):
    """A real local store that notes which thread read which object and takes a little while,
    as a remote store does."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads: list[tuple[str, str]] = []

    def get_bytes(self, uri: str) -> bytes:
        self.reads.append((threading.current_thread().name, uri))
        time.sleep(0.05)
        return super().get_bytes(uri)


def test_prefetch_reads_the_next_shards_while_the_consumer_works(tmp_path, dataset):
    uri, man = dataset
    store = RecordingStore((tmp_path / "objects").as_uri())
    with DataCache(store, spec(tmp_path, prefetch_shards=2, disk_dir=None)) as cache:
        stream = RecordStream(cache, uri)
        store.reads.clear()  # the manifest
        for step in range(4):  # one shard per step in the shard-major order
            assert len(stream.records(range(step * 10, step * 10 + 10))) == 10
        st = cache.stats()
    threads = [name for name, _ in store.reads]
    assert len(threads) == 4  # every shard read exactly once
    assert threads[0] == "MainThread" or threads.count("MainThread") == 1
    assert sum(t.startswith("datacache") for t in threads) == 3
    # Only the first shard was fetched by the consumer itself; the rest were prefetched.
    assert st["data/hit_rate_store"] == 0.25
    assert st["data/hit_rate_memory"] + st["data/hit_rate_inflight"] == 0.75
    assert st["data/prefetched"] == 3 and st["data/wait_s"] > 0


def test_stream_order_is_seeded_epochal_and_resumable(tmp_path, store, dataset):
    uri, _ = dataset
    with DataCache(store, spec(tmp_path)) as cache:
        stream = RecordStream(cache, uri)
        e0 = [r["id"] for r in stream.records(range(0, 40))]
        e1 = [r["id"] for r in stream.records(range(40, 80))]
        assert sorted(e0) == sorted(e1) == list(range(40)) and e0 != e1
        # A resumed run (new stream, same seed) sees the same records at the same positions.
        resumed = RecordStream(cache, uri).records(range(37, 52))
        assert [r["id"] for r in resumed] == (e0 + e1)[37:52]
        w = cache.window()
        assert w["data/requests"] > 0 and cache.window()["data/requests"] == 0
    with DataCache(store, spec(tmp_path, seed=1)) as cache:
        assert [r["id"] for r in RecordStream(cache, uri).records(range(40))] != e0


def test_epoch_order_agrees_with_stream_positions(tmp_path, store):
    uri = write_shards(store, "uneven", make_records(23), shard_records=5)  # 5,5,5,5,3
    with DataCache(store, spec(tmp_path)) as cache:
        stream = RecordStream(cache, uri)
        for epoch in (0, 1):
            by_position = [r["id"] for r in stream.records(range(epoch * 23, epoch * 23 + 23))]
            assert stream.epoch_order(epoch) == by_position
            assert sorted(by_position) == list(range(23))


def test_records_feed_the_trainers_task_sampler_one_shard_at_a_time(tmp_path, dataset):
    uri, _ = dataset
    store = RecordingStore((tmp_path / "objects").as_uri())
    with DataCache(store, spec(tmp_path, prefetch_shards=1, disk_dir=None)) as cache:
        train = RecordExamples(RecordStream(cache, uri))
        store.reads.clear()
        sampler = TaskSampler(train, CurriculumSpec(), seed=0, rank=0, world=1,
                              permutation=train.order)
        taken = [sampler.take(10) for _ in range(4)]
        st = cache.stats()
    prompts = [ex.prompt for batch in taken for ex in batch]
    assert sorted(prompts) == sorted(f"{i}+1=" for i in range(40))
    assert taken[0][0].reference == str(int(taken[0][0].prompt.split("+")[0]) + 1)
    assert len(store.reads) == 4  # each shard fetched once: the sampler walks shard by shard
    assert sum(name.startswith("datacache") for name, _ in store.reads) == 3
    assert st["data/hit_rate_store"] < 0.1  # 1 of 40 lookups hit the store


def test_records_without_the_task_fields_are_named(tmp_path, store):
    uri = write_shards(store, "nofield", [{"question": "1+1="}], shard_records=5)
    with DataCache(store, spec(tmp_path)) as cache:
        train = RecordExamples(RecordStream(cache, uri))
        with pytest.raises(DataError, match="no string field 'prompt'.*question"):
            train[0]
        with pytest.raises(IndexError):
            train[1]


def test_spec_refuses_non_store_sources():
    with pytest.raises(ValidationError, match="file:// or s3://"):
        DataCacheSpec(source="/tmp/x.jsonl")
    with pytest.raises(ValidationError, match="memory_mb"):
        DataCacheSpec(memory_mb=0)
    assert DataCacheSpec(source="s3://bucket/ds/manifest.json").prefetch_shards == 2


def test_write_shards_refuses_bad_input(store):
    with pytest.raises(ValueError, match="record 1 is not a JSON object"):
        write_shards(store, "bad", [{"a": 1}, [2]])
    with pytest.raises(ValueError, match="no records"):
        write_shards(store, "empty", [])


@pytest.fixture
def s3_store(s3_server):  # noqa: ARG001 - the moto server of tests/workers/conftest.py
    s3 = S3Store("s3://tasks/crucible")
    s3.client.create_bucket(Bucket="tasks")
    return s3


def test_records_stream_from_an_s3_compatible_store(tmp_path, s3_store):
    uri = write_shards(s3_store, "ds", make_records(25), shard_records=10)
    assert uri == "s3://tasks/crucible/ds/manifest.json"
    with DataCache(s3_store, spec(tmp_path, prefetch_shards=2)) as cache:
        stream = RecordStream(cache, uri)
        assert len(stream) == 25
        assert sorted(r["id"] for r in stream.records(range(25))) == list(range(25))
        with pytest.raises(ObjectMissing, match="ds/gone.jsonl does not exist"):
            cache.get(s3_store.uri("ds/gone.jsonl"))
    shutil.rmtree(tmp_path / "cache")
    with (DataCache(s3_store, spec(tmp_path, retries=0)) as cache,
          pytest.raises(DataError, match="is not in the object store")):
        cache.get("s3://elsewhere/x.jsonl")
