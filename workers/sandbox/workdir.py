"""Per-execution work directories on the host, and reading files back out of them safely.

The sandbox owns its work directory, so anything in it may be a trap: a symlink to /etc/shadow, a
FIFO that blocks forever, a huge file. Files are read back only by single-component names relative
to an fd of the directory, with O_NOFOLLOW and O_NONBLOCK, and only if they are regular files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

BASE = Path(
    os.environ.get("CRUCIBLE_SANDBOX_WORKDIRS", Path(tempfile.gettempdir()) / "crucible-sandbox")
)


class UnsafeFile(ValueError):
    """A file the host refuses to read back (symlink, not regular, bad name)."""


def create(files: dict[str, str], *, owner_uid: int, owner_gid: int) -> Path:
    """A fresh directory holding `files`, writable by the sandbox user only."""
    BASE.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(BASE, 0o711)  # the unprivileged bwrap must traverse it to bind the work directory
    path = Path(tempfile.mkdtemp(prefix="w-", dir=BASE))
    write(path, files, owner_uid=owner_uid, owner_gid=owner_gid)
    os.chown(path, owner_uid, owner_gid)
    os.chmod(path, 0o700)
    return path


def write(path: Path, files: dict[str, str], *, owner_uid: int, owner_gid: int) -> None:
    """Write files (relative names, already validated) before the program starts."""
    for name, text in files.items():
        target = path / name
        if target.parent != path:
            target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    for root, dirs, names in os.walk(path):
        for entry in [*dirs, *names]:
            os.chown(os.path.join(root, entry), owner_uid, owner_gid, follow_symlinks=False)


def read(path: Path, name: str, *, limit: int = 1 << 20) -> bytes:
    """Read one regular file the program left in its work directory, never following links."""
    if not name or "/" in name or name in (".", ".."):
        raise UnsafeFile(f"{name!r}: only plain file names in the work directory can be read")
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise UnsafeFile(f"{name!r}: {exc.strerror}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafeFile(f"{name!r} is not a regular file")
            chunks, total = [], 0
            while total < limit and (chunk := os.read(fd, min(1 << 16, limit - total))):
                chunks.append(chunk)
                total += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def remove(path: Path) -> None:
    """Delete the directory without following any link the program planted."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
