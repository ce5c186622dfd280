"""Host-side file operations inside a session's workspace, on hostile path names.

The host runs as root and the workspace belongs to the sandbox, which may plant symlinks, FIFOs
or swap a directory for a link between two calls. So a path is split into plain components
(no `..`, no NUL, absolute only under /work), and walked one component at a time with
`openat(dir_fd, name, O_NOFOLLOW | O_DIRECTORY)` from an fd of the workspace root: no symlink
is ever followed, at any depth, whatever the sandbox does meanwhile (each step holds the
directory it came from). Files are opened with O_NOFOLLOW | O_NONBLOCK and used only if
regular.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WORK = "/work"
MAX_PATH = 4096
MAX_LIST = 10_000


class PathRefused(ValueError):
    """A path that would leave the workspace, or that names something unsafe to touch."""


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # file | dir | symlink | other
    size: int


def components(path: str) -> list[str]:
    """The plain components of a workspace path (relative, or absolute under /work)."""
    if not isinstance(path, str) or "\x00" in path or len(path) > MAX_PATH:
        raise PathRefused("a path is text without NUL bytes, at most 4096 characters")
    if path.startswith("/"):
        if path != WORK and not path.startswith(WORK + "/"):
            raise PathRefused(f"{path!r}: absolute paths must lie under {WORK}")
        path = path[len(WORK):]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"{path!r}: '..' is not allowed in a workspace path")
    return parts


@contextlib.contextmanager
def _walk(root: Path, parts: list[str], *, create: bool = False,
          owner: tuple[int, int] | None = None) -> Iterator[int]:
    """An fd of the directory `parts` names under `root`, never following a link; with
    `create`, missing directories are made (owned by `owner`)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except OSError as exc:
                raise PathRefused(f"{'/'.join(parts)!r}: {part!r} is not a directory "
                                  f"({exc.strerror}); links are never followed") from exc
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _open_file(dir_fd: int, name: str, flags: int, path: str) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except IsADirectoryError as exc:
        raise PathRefused(f"{path!r} is a directory") from exc
    except OSError as exc:
        raise PathRefused(f"{path!r}: {exc.strerror} (links are never followed)") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathRefused(f"{path!r} is not a regular file")
    return fd


def write(root: Path, path: str, data: bytes, *, owner: tuple[int, int],
          mode: int = 0o644) -> None:
    """Create or replace a regular file (and its missing directories), owned by `owner`."""
    parts = components(path)
    if not parts:
        raise PathRefused("write needs a file name")
    with _walk(root, parts[:-1], create=True, owner=owner) as dir_fd:
        fd = _open_file(dir_fd, parts[-1], os.O_WRONLY | os.O_CREAT, path)
        try:
            os.ftruncate(fd, 0)
            os.fchown(fd, *owner)
            os.fchmod(fd, mode & 0o777)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def read(root: Path, path: str, *, limit: int) -> bytes:
    """A regular file's bytes; PathRefused past `limit`."""
    parts = components(path)
    if not parts:
        raise PathRefused("read needs a file name")
    with _walk(root, parts[:-1]) as dir_fd:
        fd = _open_file(dir_fd, parts[-1], os.O_RDONLY, path)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise PathRefused(f"{path!r} holds {size} bytes, more than the {limit} a read "
                                  "returns")
            chunks, total = [], 0
            while total <= limit and (chunk := os.read(fd, 1 << 20)):
                chunks.append(chunk)
                total += len(chunk)
            if total > limit:
                raise PathRefused(f"{path!r} grew past the {limit} bytes a read returns")
            return b"".join(chunks)
        finally:
            os.close(fd)


def listdir(root: Path, path: str) -> list[Entry]:
    """A directory's entries (links reported as links, not followed), sorted by name."""
    with _walk(root, components(path)) as dir_fd:
        found: list[Entry] = []
        with os.scandir(dir_fd) as it:
            for item in it:
                if len(found) >= MAX_LIST:
                    break
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "dir"
                        if stat.S_ISDIR(st.st_mode) else "file"
                        if stat.S_ISREG(st.st_mode) else "other")
                found.append(Entry(item.name, kind, st.st_size if kind == "file" else 0))
    return sorted(found, key=lambda e: e.name)
