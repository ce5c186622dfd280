"""Checkpoint objects on a worker host: streamed unpacking and the pruned model cache."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from workers.model_cache import ModelCache, cache_budget_bytes, cached_model, fetch_tar
from workers.storage import LocalStore, open_store


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def checkpoint(store, key: str, size: int) -> str:
    return store.put_bytes(key, tar_bytes({"hf/config.json": b"{}", "hf/weights.bin": b"w" * size}))


def test_fetch_tar_streams_the_object_into_a_complete_folder(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    uri = checkpoint(store, "ckpt/step-1.tar", 5000)
    folder = fetch_tar(store, uri, tmp_path / "cache" / "entry")
    assert (folder / "hf" / "weights.bin").read_bytes() == b"w" * 5000
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["entry"]  # no temp left


def test_fetch_tar_refuses_members_that_escape_and_leaves_nothing(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    uri = store.put_bytes("evil.tar", tar_bytes({"hf/ok": b"1", "../../outside": b"x"}))
    with pytest.raises(tarfile.TarError):
        fetch_tar(store, uri, tmp_path / "cache" / "entry")
    assert list((tmp_path / "cache").iterdir()) == []
    assert not (tmp_path / "outside").exists()


def test_fetch_tar_streams_from_a_real_s3_server(s3_server, tmp_path):
    import boto3

    boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).create_bucket(Bucket="ckpts")
    store = open_store("s3://ckpts/objects")
    uri = checkpoint(store, "runs/r/step-2.tar", 3 << 20)
    folder = fetch_tar(store, uri, tmp_path / "entry")
    assert (folder / "hf" / "weights.bin").stat().st_size == 3 << 20


def test_a_cached_model_is_the_hf_folder_under_var_models_held_until_the_stack_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))
    store = LocalStore((tmp_path / "objects").as_uri())
    uri = checkpoint(store, "runs/r/step-1.tar", 100)
    cache = ModelCache(tmp_path / "var" / "models", budget_bytes=0)
    with contextlib.ExitStack() as hold:
        folder = cached_model(store, uri, hold)
        assert folder == tmp_path / "var" / "models" / ModelCache.key(uri) / "hf"
        assert (folder / "weights.bin").read_bytes() == b"w" * 100
        assert cache.prune() == []  # in use: kept though over the budget
    assert cache.prune() == [ModelCache.key(uri)]


def test_the_cache_prunes_least_recently_used_entries_to_its_budget(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    uris = [checkpoint(store, f"c{i}.tar", 400_000) for i in range(3)]
    cache = ModelCache(tmp_path / "models", budget_bytes=900_000)  # room for two entries
    for uri in uris[:2]:
        with cache.use(store, uri) as folder:
            assert (folder / "hf" / "config.json").is_file()
        time.sleep(0.02)  # distinct last-use times
    with cache.use(store, uris[0]):  # used again: now the most recent
        pass
    time.sleep(0.02)
    with cache.use(store, uris[2]):
        pass
    kept = sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir())
    assert kept == sorted([ModelCache.key(uris[0]), ModelCache.key(uris[2])])


def test_an_entry_in_use_by_another_process_is_never_pruned(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    old, new = checkpoint(store, "old.tar", 400_000), checkpoint(store, "new.tar", 400_000)
    root = tmp_path / "models"
    with ModelCache(root, budget_bytes=10**9).use(store, old):
        pass
    # Another process on the host holds the old entry (its shared lock) while this one
    # fetches a new entry into a cache with room for one.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)",
         str(root / f"{ModelCache.key(old)}.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with ModelCache(root, budget_bytes=500_000).use(store, new):
            pass
        assert (root / ModelCache.key(old) / "hf" / "weights.bin").is_file()
    finally:
        holder.kill()
        holder.wait()
    # Released: the next prune removes it (least recently used, over budget).
    assert ModelCache(root, budget_bytes=500_000).prune() == [ModelCache.key(old)]
    assert (root / ModelCache.key(new)).is_dir()


def test_the_budget_setting_is_checked(monkeypatch):
    monkeypatch.setenv("CRUCIBLE_MODEL_CACHE_GB", "0.5")
    assert cache_budget_bytes() == 512 * 1024**2
    monkeypatch.setenv("CRUCIBLE_MODEL_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="CRUCIBLE_MODEL_CACHE_GB must be a number"):
        cache_budget_bytes()


def test_a_missing_entry_after_a_prune_is_fetched_again(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    uri = checkpoint(store, "c.tar", 1000)
    cache = ModelCache(tmp_path / "models", budget_bytes=0)
    with cache.use(store, uri) as folder:
        assert folder.is_dir()  # in use: kept despite a zero budget
    assert cache.prune() == [ModelCache.key(uri)]
    with cache.use(store, uri) as again:
        assert (Path(again) / "hf" / "config.json").is_file()
