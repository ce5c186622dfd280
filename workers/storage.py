"""The object store: dataset records, checkpoints and reports.

One URL picks the backend: ``file:///abs/folder`` (the embedded default, ``var/objects``)
or ``s3://bucket/prefix`` for any S3-compatible service (``S3_ENDPOINT_URL`` and the usual
``AWS_*`` variables). Objects are addressed by ``<store-url>/<key>`` URIs, so a URI
recorded in the database is readable by any web process or worker configured with the
same store. Plain Python + boto3: the web and the workers both use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import unquote, urlparse

from workers.paths import var_dir
from workers.protocol import ClaimedRun


class ObjectStore(Protocol):
    url: str

    def put_file(self, key: str, path: Path) -> str: ...
    def put_bytes(self, key: str, data: bytes) -> str: ...
    def get_bytes(self, uri: str) -> bytes: ...
    def open_lines(self, uri: str) -> Iterator[bytes]: ...
    def open_binary(self, uri: str) -> IO[bytes]: ...
    def exists(self, uri: str) -> bool: ...
    def delete(self, uri: str) -> None: ...


def _safe_key(key: str) -> str:
    parts = [p for p in key.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid object key: {key!r}")
    return "/".join(parts)


class LocalStore:
    """Objects as files under one folder; writes are atomic (temp file + rename)."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.root = Path(unquote(parsed.path)).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()

    def _path(self, uri: str) -> Path:
        if not uri.startswith(self.url + "/"):
            raise ValueError(f"{uri!r} is not in the object store {self.url}")
        path = (self.root / _safe_key(uri[len(self.url) + 1 :])).resolve()
        if self.root not in path.parents:
            raise ValueError(f"{uri!r} escapes the object store")
        return path

    def uri(self, key: str) -> str:
        return f"{self.url}/{_safe_key(key)}"

    def put_file(self, key: str, path: Path) -> str:
        uri = self.uri(key)
        target = self._path(uri)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return uri

    def put_bytes(self, key: str, data: bytes) -> str:
        uri = self.uri(key)
        target = self._path(uri)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return uri

    def get_bytes(self, uri: str) -> bytes:
        return self._path(uri).read_bytes()

    def open_lines(self, uri: str) -> Iterator[bytes]:
        with open(self._path(uri), "rb") as handle:
            yield from handle

    def open_binary(self, uri: str) -> IO[bytes]:
        """The object as a readable stream (checkpoints are read without loading them whole)."""
        return open(self._path(uri), "rb")  # noqa: SIM115 - the caller closes it

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def delete(self, uri: str) -> None:
        """Remove the object; one that is already gone is not an error."""
        self._path(uri).unlink(missing_ok=True)


class S3Store:
    """Any S3-compatible service through boto3 (AWS, MinIO, Ceph, moto in tests)."""

    def __init__(self, url: str) -> None:
        import boto3  # imported lazily: the embedded default never needs it

        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.url = url.rstrip("/")
        self.client = boto3.client(
            "s3",
            endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None,
            region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        )

    def _key(self, uri: str) -> str:
        if not uri.startswith(self.url + "/"):
            raise ValueError(f"{uri!r} is not in the object store {self.url}")
        return "/".join(p for p in (self.prefix, _safe_key(uri[len(self.url) + 1 :])) if p)

    def uri(self, key: str) -> str:
        return f"{self.url}/{_safe_key(key)}"

    def put_file(self, key: str, path: Path) -> str:
        uri = self.uri(key)
        self.client.upload_file(str(path), self.bucket, self._key(uri))
        return uri

    def put_bytes(self, key: str, data: bytes) -> str:
        uri = self.uri(key)
        self.client.put_object(Bucket=self.bucket, Key=self._key(uri), Body=data)
        return uri

    def get_bytes(self, uri: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(uri))["Body"].read()

    def open_lines(self, uri: str) -> Iterator[bytes]:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(uri))["Body"]
        yield from body.iter_lines(keepends=True)

    def open_binary(self, uri: str) -> IO[bytes]:
        """The object's body as a stream, read in chunks as the caller consumes it."""
        return self.client.get_object(Bucket=self.bucket, Key=self._key(uri))["Body"]

    def presigned_url(self, uri: str, *, filename: str, expires_s: int = 300) -> str:
        """A time-limited GET URL for the object, downloaded as ``filename``."""
        return self.client.generate_presigned_url(
            "get_object", ExpiresIn=expires_s,
            Params={"Bucket": self.bucket, "Key": self._key(uri),
                    "ResponseContentDisposition": f'attachment; filename="{filename}"'})

    def exists(self, uri: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(uri))
        except self.client.exceptions.ClientError:
            return False
        return True

    def delete(self, uri: str) -> None:
        """Remove the object (S3 answers a missing key with success too)."""
        self.client.delete_object(Bucket=self.bucket, Key=self._key(uri))


def open_store(url: str) -> LocalStore | S3Store:
    scheme = urlparse(url).scheme
    if scheme == "file":
        return LocalStore(url)
    if scheme == "s3":
        return S3Store(url)
    raise ValueError(f"unsupported OBJECT_STORE_URL {url!r}: use file:///path or s3://bucket")


def default_store() -> LocalStore | S3Store:
    """The store named by OBJECT_STORE_URL, else ``var/objects`` beside the code."""
    url = os.environ.get("OBJECT_STORE_URL", "").strip()
    if not url:
        url = (var_dir() / "objects").as_uri()
    return open_store(url)


def run_key(run: Mapping[str, Any] | ClaimedRun, name: str) -> str:
    """The key of an object a run writes: under the prefix the API hands the run at claim
    (``object_prefix``, ``teams/<team id>/runs/<run id>``), the only place the API accepts
    the run's reports from. A run document made outside the API (engine tests, the CLI)
    has no prefix and writes under ``runs/<id>``."""
    if isinstance(run, ClaimedRun):
        return f"{run.object_prefix}/{name}"
    prefix = run.get("object_prefix") or f"runs/{run['id']}"
    return f"{prefix}/{name}"


def read_text(store: ObjectStore, uri: str) -> str:
    return store.get_bytes(uri).decode()


__all__ = ["LocalStore", "ObjectStore", "S3Store", "default_store", "open_store", "run_key"]
