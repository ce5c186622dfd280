"""Per-execution work directories on the host, and reading files back out of them safely.

Each work directory is a tmpfs of its own, mounted on a fresh directory, with a size and an inode
cap: RLIMIT_FSIZE bounds one file, the tmpfs bounds them all, so a program writing many files gets
ENOSPC instead of filling the host's disk. (Its pages are also charged to the sandbox's memory
cgroup while the program writes them.)

The sandbox owns its work directory, so anything in it may be a trap: a symlink to /etc/shadow, a
FIFO that blocks forever, a huge file. Files are read back only by single-component names relative
to an fd of the directory, with O_NOFOLLOW and O_NONBLOCK, and only if they are regular files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

BASE = Path(
    os.environ.get("CRUCIBLE_SANDBOX_WORKDIRS", Path(tempfile.gettempdir()) / "crucible-sandbox")
)


INODES = 16_384
"""Files and directories one work directory may hold (tmpfs nr_inodes)."""
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 0x2, 0x4, 0x20
_MNT_DETACH = 0x2
_libc = ctypes.CDLL(None, use_errno=True)
_base_ready = False


class UnsafeFile(ValueError):
    """A file the host refuses to read back (symlink, not regular, bad name)."""


class WorkdirError(OSError):
    """The host could not give the program a size-capped work directory."""


def files_bytes(files: dict[str, str]) -> int:
    """Space the request's own files take, rounded up to whole pages per file."""
    return sum(-(-len(text.encode()) // 4096) * 4096 + 4096 for text in files.values())


def _mount_tmpfs(path: Path, size_bytes: int, uid: int, gid: int, *, remount: bool) -> None:
    options = f"size={size_bytes},nr_inodes={INODES},mode=0700,uid={uid},gid={gid}"
    flags = _MS_NOSUID | _MS_NODEV | (_MS_REMOUNT if remount else 0)
    if _libc.mount(b"crucible-work", os.fsencode(path), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise WorkdirError(err, f"cannot {'resize' if remount else 'mount'} the size-capped "
                                f"tmpfs work directory ({options}): {os.strerror(err)}"
                                " (the sandbox supervisor needs root with CAP_SYS_ADMIN)")


def create(
    files: dict[str, str], *, owner_uid: int, owner_gid: int, size_bytes: int = 64 << 20
) -> Path:
    """A fresh size-capped directory holding `files`, writable by the sandbox user only;
    `size_bytes` is the room left for the program on top of the files."""
    global _base_ready
    if not _base_ready:
        BASE.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(BASE, 0o711)  # the unprivileged bwrap must traverse it to bind the work dir
        sweep_orphans()
        _base_ready = True
    path = Path(tempfile.mkdtemp(prefix=f"w-{os.getpid()}-", dir=BASE))
    try:
        _mount_tmpfs(path, files_bytes(files) + size_bytes, owner_uid, owner_gid, remount=False)
        write(path, files, owner_uid=owner_uid, owner_gid=owner_gid)
    except BaseException:
        remove(path)
        raise
    return path


def resize(path: Path, room_bytes: int, *, owner_uid: int, owner_gid: int) -> None:
    """Cap the work directory at what it holds now plus `room_bytes`: the run phase after a
    compile (compilers get their own, larger room), or a warm sandbox taking a request."""
    st = os.statvfs(path)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    _mount_tmpfs(path, used + room_bytes, owner_uid, owner_gid, remount=True)


def capacity(path: Path) -> tuple[int, int]:
    """(total bytes, free bytes) of a work directory."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def write(path: Path, files: dict[str, str], *, owner_uid: int, owner_gid: int) -> None:
    """Write files (relative names, already validated) before the program starts, owned by the
    sandbox user (the directories made for them too)."""
    for name, text in files.items():
        target = path / name
        if target.parent != path:
            made = [p for p in reversed(target.relative_to(path).parents) if str(p) != "."]
            for rel in made:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path / rel, 0o755)
                    os.chown(path / rel, owner_uid, owner_gid, follow_symlinks=False)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.fchown(fd, owner_uid, owner_gid)
            view = memoryview(text.encode())
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans(base: Path | None = None) -> list[Path]:
    """Unmount and delete the work directories of supervisors that died without cleaning up
    (a worker killed with SIGKILL leaves its tmpfs mounts behind). A directory is named
    ``w-<supervisor pid>-…``; only those whose pid is gone are touched, so the live
    supervisors sharing this host's folder keep theirs (a reused pid only delays a sweep).
    Run once per process, before its first work directory."""
    swept = []
    for entry in (base or BASE).glob("w-*-*"):
        pid = entry.name.split("-")[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # another supervisor may be sweeping it too
            remove(entry)
            swept.append(entry)
    return swept


def remove(path: Path) -> None:
    """Unmount the work directory's tmpfs (lazily: a sandbox still being torn down may hold it),
    then delete the directory without following any link the program planted."""
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
            raise WorkdirError(err, f"cannot unmount {path}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
