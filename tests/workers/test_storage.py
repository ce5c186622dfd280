"""The object store on a local folder and on a real S3-compatible server (moto, offline)."""

from __future__ import annotations

import os

import pytest

from workers.storage import LocalStore, open_store


def test_local_store_round_trip_and_atomic_write(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    uri = store.put_bytes("a/b/c.jsonl", b'{"x":1}\n{"x":2}\n')
    assert uri == f"{store.url}/a/b/c.jsonl"
    assert store.get_bytes(uri) == b'{"x":1}\n{"x":2}\n'
    assert list(store.open_lines(uri)) == [b'{"x":1}\n', b'{"x":2}\n']
    assert store.exists(uri) and not store.exists(f"{store.url}/nope")
    assert not [p for p in (tmp_path / "objects").rglob(".tmp-*")]
    store.delete(uri)
    assert not store.exists(uri)
    store.delete(uri)  # already gone: not an error
    with pytest.raises(ValueError):
        store.delete((tmp_path / "elsewhere").as_uri())


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "", "/"])
def test_local_store_refuses_keys_that_escape(tmp_path, key):
    store = LocalStore((tmp_path / "objects").as_uri())
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_local_store_refuses_uris_of_another_store(tmp_path):
    store = LocalStore((tmp_path / "objects").as_uri())
    with pytest.raises(ValueError):
        store.get_bytes((tmp_path / "elsewhere" / "x").as_uri())


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="file:///path or s3://bucket"):
        open_store("ftp://host/x")


def test_s3_store_round_trip_against_a_real_s3_server(s3_server, tmp_path):
    import boto3

    boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).create_bucket(
        Bucket="crucible")
    store = open_store("s3://crucible/prefix")
    source = tmp_path / "records.jsonl"
    source.write_bytes(b"".join(b'{"i":%d}\n' % i for i in range(1000)))
    uri = store.put_file("datasets/ab/abc.jsonl", source)
    assert uri == "s3://crucible/prefix/datasets/ab/abc.jsonl"
    lines = list(store.open_lines(uri))
    assert len(lines) == 1000 and lines[0] == b'{"i":0}\n'
    assert store.exists(uri) and not store.exists("s3://crucible/prefix/missing")
    assert store.get_bytes(store.put_bytes("r.json", b"{}")) == b"{}"
    store.delete(uri)
    assert not store.exists(uri)
    store.delete(uri)  # S3 answers a missing key with success
    assert store.exists("s3://crucible/prefix/r.json")
