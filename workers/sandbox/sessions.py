"""Sandbox sessions: a workspace that lives across calls, with snapshots, rollback and forks.

A session is one long-lived sandbox with the isolation of an execution (bubblewrap with its own
user, PID, network, IPC, UTS and mount namespaces, the same seccomp filter and read-only system
mounts, a uid of its own from `uids`, the start-up gate that lowers the rlimits and drops
privileges) whose PID 1 is a small agent (`harness/session_agent.py`) running the commands the
host sends. Background processes started by one call are there for the next (same PID and
network namespace: a server on 127.0.0.1 answers a later call). Quotas hold for the whole
session: one cgroup with memory (no swap), pids and CPU accounting for every process it ever
runs, a size-capped workspace, a lifetime and an idle timeout.

The workspace (`/work` inside) is an overlayfs the host mounts as root: read-only lower layers
(snapshots, on disk under `BASE/layers`) and a writable upper directory on a tmpfs of the
session's own, sized at its disk quota. So:

- `snapshot()` freezes the session's processes (cgroup freezer), copies the upper directory (only
  what changed since the layers below; whiteouts and overlay xattrs kept) into a new immutable
  layer, and thaws them: the snapshot is that layer on top of the session's lower ones.
- `fork(id)` mounts a fresh overlay on the snapshot's layers with an empty upper: nothing is
  copied, however large the workspace, which is what a GRPO group of 8 needs from one prepared
  workspace. Each fork runs as a uid of its own, so the files it inherits are re-owned through
  the overlay with `metacopy=on`: a chown copies up the inode, never the data.
- `restore(id)` stops the session's processes, mounts the snapshot's layers with an empty upper
  and starts a fresh agent (files roll back; processes do not survive a rollback).

Why this and not the alternatives on this host (ext4, kernel 6.18, root): ext4 has no reflinks,
so `cp --reflink` is a full copy; hard-link trees share inodes, so a write in a fork changes
the parent's file unless every writer breaks the link first (nothing in the sandbox would); the
supervisor is root on the host, so overlayfs needs neither a user namespace nor
fuse-overlayfs. Measured figures are in docs/sandbox.md.

A group of forks (`fork_many`) is set up side by side, and `keep_warm` keeps sandboxes started
ahead: the session's root and /crucible are shared bind mounts of themselves, so the overlay and
the lent folders the host mounts on them later propagate into the running sandbox's (slave) copy
of them; a fork then costs the mounts and the chown, not a sandbox and interpreter start-up.

Sessions live in the process that created them (`--die-with-parent`): a session host process
(`session_host.py`) keeps them for the control plane.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import secrets
import select
import shutil
import struct
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cgroups, egress_proxy, process, uids, wspath
from .harness import source as harness_source
from .policy import bwrap, seccomp
from .spec import EgressPolicy, Limits, SessionExec, SessionLimits, SessionStatus

BASE = Path(os.environ.get("CRUCIBLE_SANDBOX_SESSIONS", "") or "/var/tmp/crucible-sessions")
PYTHON = "/usr/bin/python3"
READ_LIMIT = 16 << 20
MAX_LAYERS = 48  # a deeper snapshot is flattened into one layer (overlay's lowerdir has limits)
_REPLY_GRACE_S = 5.0
_FORK_THREADS = max(2, min(4, os.cpu_count() or 2))  # fork_many's set-up threads
_CLOSED_KEPT = 10_000  # closed sessions whose reason the manager still gives
_libc = ctypes.CDLL(None, use_errno=True)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MS_REMOUNT, _MS_BIND, _MS_SHARED = 0x20, 0x1000, 1 << 20
_MNT_DETACH = 0x2


class SessionError(RuntimeError):
    """The engine could not do what was asked (not the commands' fault)."""


class SessionClosed(SessionError):
    """The session is gone: closed, expired, idle, out of CPU, or lost."""

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"session {session_id} is closed ({reason})")
        self.reason = reason


class UnknownSnapshot(KeyError):
    pass


Binds = tuple[tuple[str, str], ...]
"""Read-only binds into a session, (host path, path inside): what the engine chooses to lend
it (e.g. an agent harness's model socket and libraries), never a tenant's input. The host
mounts each one read-only under the session's /crucible (a shared mount the sandbox sees), so a
pre-started sandbox can be lent them after its start; binds may not nest."""

_BIND_TARGETS = ("/crucible/",)


def _check_binds(binds: Binds) -> Binds:
    """Binds land under /crucible only: never over /work, /usr, /proc or the rest."""
    out = []
    for host, inside in binds:
        norm = os.path.normpath(inside)
        if not norm.startswith(_BIND_TARGETS) or norm != inside:
            raise ValueError(f"a session bind must name a normalised path under /crucible/, "
                             f"not {inside!r}")
        if not os.path.isabs(host) or not os.path.exists(host):
            raise ValueError(f"a session bind's host path must exist: {host!r}")
        out.append((host, inside))
    for _host, inside in out:
        for _other, other in out:
            if inside != other and (inside + "/").startswith(other + "/"):
                raise ValueError(f"session binds may not nest: {inside!r} is inside {other!r}")
    if len({inside for _h, inside in out}) != len(out):
        raise ValueError("two session binds name the same path")
    return tuple(out)


@dataclass
class ExecResult:
    status: SessionStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_ms: int = 0
    cpu_ms: int = 0  # the session's CPU during the call (background processes included)
    pid: int | None = None  # a background command's pid (inside the session)
    message: str = ""

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["status"] = self.status.value
        out["stdout"] = self.stdout.decode(errors="replace")
        out["stderr"] = self.stderr.decode(errors="replace")
        return out


@dataclass(frozen=True)
class Snapshot:
    id: str
    layers: tuple[str, ...]  # layer ids, top first
    owner_uid: int
    bytes: int  # what its own (top) layer holds
    created: float = field(default_factory=time.time)


def _mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(),
                   _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SessionError(f"cannot mount {fstype} on {target} ({options[:200]}): "
                           f"{os.strerror(err)} (sessions need root with CAP_SYS_ADMIN)")


def _bind(source: str | Path, target: Path, *, read_only: bool = False,
          shared: bool = False) -> None:
    """Bind `source` on `target` (read-only, nosuid, nodev when asked; `shared`: mounts made
    under `target` later propagate to the copies a sandbox made of it, which is how a
    session's workspace and lent folders reach a sandbox that is already running)."""
    def call(src: str | None, flags: int) -> None:
        if _libc.mount(None if src is None else os.fsencode(src), os.fsencode(target), None,
                       flags, None) != 0:
            err = ctypes.get_errno()
            raise SessionError(f"cannot bind {source} on {target}: {os.strerror(err)}")

    call(str(source), _MS_BIND)
    if read_only:
        call(None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    if shared:
        call(None, _MS_SHARED)


def _umount(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise SessionError(f"cannot unmount {target}: {os.strerror(err)}")


RSYNC = "/usr/bin/rsync"


def _copy_tree(src: Path, dest: Path, link_dest: Path | None = None) -> None:
    """Copy an overlay upper directory as a layer, keeping whiteouts (0/0 character devices),
    the overlay's trusted.* xattrs, owners, modes and sparse metacopy files. With rsync and a
    previous snapshot's layer of the same session (`link_dest`), unchanged files (same size,
    mtime, mode, owner, xattrs) are hard links to it, so a session's second snapshot copies
    only what changed since its first (layers are immutable: sharing inodes is safe). Without
    rsync, `cp -a` copies everything."""
    if os.access(RSYNC, os.X_OK):
        argv = [RSYNC, "-aHSX", "--numeric-ids", "--modify-window=-1"]
        if link_dest is not None and link_dest.is_dir():
            argv.append(f"--link-dest={link_dest}")
        argv += [f"{src}/", f"{dest}/"]
    else:
        argv = ["cp", "-a", "--sparse=always", "--", str(src), str(dest)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SessionError(f"cannot copy the workspace into a snapshot: {done.stderr[-500:]}")


def _tree_bytes(path: Path) -> int:
    """Bytes a layer holds on its own: files hard-linked with another layer are not counted."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_nlink == 1:
                    total += st.st_blocks * 512
    return total


class _Freezer:
    """Stops every process of a session while its upper directory is copied (a consistent
    snapshot): the v1 freezer hierarchy or v2's cgroup.freeze; a no-op where neither exists."""

    V1 = Path("/sys/fs/cgroup/freezer/crucible-sessions")

    def __init__(self, name: str, group: cgroups.Cgroup) -> None:
        self.state: Path | None = None
        if isinstance(group, cgroups.CgroupV2):
            self.state = group.dir / "cgroup.freeze"
            self.dir: Path | None = None
        elif self.V1.parent.is_dir():
            self.dir = self.V1 / name
            with contextlib.suppress(OSError):
                self.dir.mkdir(parents=True)
                self.state = self.dir / "freezer.state"

    def add(self, pid: int) -> None:
        if self.dir is not None and self.state is not None:
            (self.dir / "cgroup.procs").write_text(str(pid))

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        if self.state is None:
            yield None
            return
        v2 = self.state.name == "cgroup.freeze"
        self.state.write_text("1" if v2 else "FROZEN")
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                text = (self.state.parent / "cgroup.events").read_text() if v2 else \
                    self.state.read_text()
                if ("frozen 1" in text) if v2 else text.strip() == "FROZEN":
                    break
                time.sleep(0.001)
            yield None
        finally:
            self.state.write_text("0" if v2 else "THAWED")

    def remove(self) -> None:
        if self.dir is not None:
            with contextlib.suppress(OSError):
                (self.dir / "freezer.state").write_text("THAWED")
            for _ in range(100):
                try:
                    self.dir.rmdir()
                    return
                except FileNotFoundError:
                    return
                except OSError:
                    time.sleep(0.01)


class Session:
    """One workspace and its sandbox. Calls are serialised per session (one exec at a time;
    background processes run alongside)."""

    def __init__(self, manager: SessionManager, limits: SessionLimits, layers: tuple[str, ...],
                 layers_owner: int | None, binds: Binds = (),
                 egress: EgressPolicy | None = None, wait: bool = True,
                 blank: bool = False, inet: bool = False) -> None:
        """`wait=False` returns once the agent is spawned (and inherited files re-owned),
        before its interpreter is ready: `finish_start()` completes it. `fork_many` uses it
        to overlap the start-ups of a group. `blank=True` makes a pre-started sandbox with
        no workspace yet (`inet`: with the egress policy's seccomp and environment), which
        `adopt()` later turns into a session of some layers (the manager's warm pool)."""
        self.manager = manager
        self.binds = _check_binds(binds)
        self.egress = egress
        self.proxy: egress_proxy.EgressProxy | None = None
        self._needs_reown: bool = False  # set when the workspace is mounted
        self.inet = inet or egress is not None
        self.id = secrets.token_hex(8)
        self.limits = limits
        self.created = time.monotonic()
        self.last_used = self.created
        self.closed_reason: str | None = None
        self._lock = threading.RLock()
        self._busy = 0
        self._ending: str | None = None  # set by the watchdog while it kills the session
        self.uid = uids.lease()
        self.layers = layers
        self.dir = BASE / "s" / f"{os.getpid()}-{self.id}"
        self.scratch = self.dir / "scratch"
        self.root = self.dir / "root"
        self.lent = self.dir / "crucible"  # /crucible inside: binds are mounted here
        self.proc: subprocess.Popen[bytes] | None = None
        self.cgroup: cgroups.Cgroup | None = None
        self.freezer: _Freezer | None = None
        self._seen: set[int] = set()
        try:
            self.dir.mkdir(parents=True, mode=0o711)
            self.scratch.mkdir(mode=0o700)
            self.root.mkdir(mode=0o755)
            self.lent.mkdir(mode=0o755)
            # shared binds of themselves: the overlay and the lent folders mounted on them,
            # now or after the agent started, show in the sandbox (a slave copy); one way only
            _bind(self.root, self.root, shared=True)
            _bind(self.lent, self.lent, shared=True)  # read-only inside (bwrap --ro-bind)
            self.cgroup = cgroups.create(memory_bytes=limits.memory_mb << 20, pids=limits.pids)
            if isinstance(self.cgroup, cgroups.CgroupV2):  # an OOM kills one process, not all
                with contextlib.suppress(OSError):
                    (self.cgroup.dir / "memory.oom.group").write_text("0")
            self.freezer = _Freezer(self.cgroup.name, self.cgroup)
            if egress is not None:
                self.proxy = egress_proxy.EgressProxy(egress,
                                                      open_networks=manager.egress_open)
            if blank:
                self._spawn_agent()
                self._await_agent()
            else:
                self._mount_workspace(layers, layers_owner)
                self._lend()
                self._begin_agent()
                if wait:
                    self._await_agent()
        except BaseException:
            self._teardown()
            raise

    def adopt(self, layers: tuple[str, ...], layers_owner: int | None, binds: Binds = (),
              egress: EgressPolicy | None = None) -> None:
        """Give a pre-started (blank) sandbox its workspace: the overlay is mounted on its
        shared root (the running sandbox sees it at /work), the inherited files re-owned, the
        binds lent, the proxy started; its lifetime starts now. On failure it is torn down."""
        try:
            if self.inet != (egress is not None):
                raise SessionError("a pre-started sandbox's network differs from the policy's")
            self.binds = _check_binds(binds)
            self.egress = egress
            if egress is not None:
                self.proxy = egress_proxy.EgressProxy(egress,
                                                      open_networks=self.manager.egress_open)
            self._mount_workspace(layers, layers_owner)
            if self._needs_reown:
                self._reown()
                self._needs_reown = False
            self._lend()
            if self.proxy is not None:
                self.proxy.listen_in(self._agent_pid())
            self.created = self.last_used = time.monotonic()
        except BaseException:
            self._teardown()
            raise

    def _lend(self) -> None:
        """Mount each bind read-only under the session's /crucible (a shared mount: it
        reaches the sandbox whether or not it runs yet)."""
        for host, inside in self.binds:
            target = self.lent / inside.removeprefix("/crucible/")
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            if os.path.isdir(host):
                target.mkdir(exist_ok=True, mode=0o755)
            else:
                target.touch(mode=0o644, exist_ok=True)
            _bind(host, target, read_only=True)

    def finish_start(self) -> None:
        """Wait for an agent spawned with `wait=False`; on failure the session is closed."""
        try:
            self._await_agent()
        except BaseException:
            self.close("failed to start")
            raise

    # -- set-up and teardown --------------------------------------------------------------------

    def _mount_workspace(self, layers: tuple[str, ...], layers_owner: int | None) -> None:
        _mount("crucible-session", self.scratch, "tmpfs",
               f"size={self.limits.disk_mb << 20},nr_inodes={max(16_384, self.limits.disk_mb * 64)}"
               ",mode=0700")
        (self.scratch / "upper").mkdir(mode=0o755)
        (self.scratch / "work").mkdir(mode=0o700)
        os.chown(self.scratch / "upper", self.uid, self.uid)
        lower = ":".join(str(self.manager.layer_path(layer)) for layer in layers) or str(
            self.manager.empty_layer())
        _mount("crucible-session", self.root, "overlay",
               f"lowerdir={lower},upperdir={self.scratch / 'upper'},"
               f"workdir={self.scratch / 'work'},metacopy=on,redirect_dir=on")
        os.chmod(self.root, 0o755)
        os.chown(self.root, self.uid, self.uid)
        self.layers = layers
        self._last_layer: str | None = None  # the upper's copy at this session's last snapshot
        self._needs_reown = bool(layers) and layers_owner != self.uid

    def _reown(self) -> None:
        """Give the inherited files to this session's uid: with metacopy a chown copies up
        the inode only (the data stays in the layer)."""
        for dirpath, dirs, files in os.walk(self.root):
            for name in (*dirs, *files):
                with contextlib.suppress(OSError):
                    os.chown(os.path.join(dirpath, name), self.uid, self.uid,
                             follow_symlinks=False)

    def _unmount_workspace(self) -> None:
        _umount(self.root)
        _umount(self.scratch)

    def _start_agent(self) -> None:
        self._begin_agent()
        self._await_agent()

    def _begin_agent(self) -> None:
        """Start the sandbox and its agent; inherited files are re-owned while the agent's
        interpreter starts (the agent touches no file before its first command)."""
        self._spawn_agent()
        if self._needs_reown:
            self._reown()
            self._needs_reown = False

    def _await_agent(self) -> None:
        ready = self._receive(10.0)
        if not ready.get("ready"):
            raise SessionError(f"the session agent did not start: {ready}")
        if self.proxy is not None:  # before the first command: the agent is up, its netns too
            try:
                self.proxy.listen_in(self._agent_pid())
            except (egress_proxy.EgressError, OSError) as exc:
                raise SessionError(f"cannot lend the session its egress proxy: {exc}") from exc

    def _agent_pid(self) -> int:
        """The agent's host pid: bwrap's only child (PID 1 of the session's namespaces)."""
        assert self.proc is not None
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if len(children) != 1:
            raise SessionError(f"the session's bwrap has {len(children)} children, not 1")
        return int(children[0])

    def _spawn_agent(self) -> None:
        assert self.cgroup is not None and self.freezer is not None
        limits = Limits(memory_mb=self.limits.memory_mb, pids=min(self.limits.pids, 4096),
                        file_size_mb=min(self.limits.file_size_mb, 4096),
                        open_files=self.limits.open_files, tmpfs_mb=self.limits.tmpfs_mb)
        sec_fd = seccomp.filter_fd(inet=self.inet)
        env = {"HOME": "/work"}
        if self.inet:
            env |= egress_proxy.session_env()
        # the agent's source comes on a memfd, so /proc/1/cmdline stays short
        src_fd = process.memfd(harness_source("session_agent.py").encode(), "crucible-agent")
        try:
            inner = bwrap.command(
                workdir=self.root, argv=[PYTHON, "-I", "-S", "-c",
                                         f"import os;exec(compile(os.read({src_fd},1<<20),"
                                         f"'session_agent','exec'))"],
                env=env, seccomp_fd=sec_fd,
                tmpfs_bytes=self.limits.tmpfs_mb << 20,
                ro_binds=((str(self.lent), "/crucible"),), as_pid_1=True)
            process.become_subreaper()
            argv = [*process.gate_argv(limits, self.limits.cpu_s * 1000, self.uid), *inner]
            # Forked from the manager's own long-lived thread: bwrap's --die-with-parent is a
            # parent-death signal, which the kernel sends when the *thread* that forked it
            # ends (a per-request server thread would kill the session with the request).
            self.proc = self.manager.spawn(lambda: subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, pass_fds=[sec_fd, src_fd],
                env={"PATH": bwrap.PATH}, cwd="/"))
        finally:
            os.close(sec_fd)
            os.close(src_fd)
        process.track(self.proc.pid)
        self.cgroup.add(self.proc.pid)
        self.freezer.add(self.proc.pid)
        assert self.proc.stdin is not None
        os.write(self.proc.stdin.fileno(), b"go\n")

    def _stop_processes(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError, cgroups.CgroupError):
                self._seen |= self.cgroup.kill()
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            process.untrack(self.proc.pid)
            self.proc = None
        process.reap(self._seen)
        process.sweep()
        self._seen.clear()

    def _teardown(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self._stop_processes()
        with contextlib.suppress(SessionError):
            self._unmount_workspace()
        for shared in (self.lent, self.root):  # the binds lent (detached with it), the root
            with contextlib.suppress(SessionError):
                _umount(shared)
        if self.freezer is not None:
            self.freezer.remove()
        clean = True
        if self.cgroup is not None:
            try:
                self.cgroup.remove(on_busy=process.sweep)
            except OSError:
                clean = False
        if clean:
            uids.release(self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- talking to the agent ------------------------------------------------------------------

    def _send(self, request: dict[str, object]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = json.dumps(request).encode()
        try:
            os.write(self.proc.stdin.fileno(), struct.pack(">I", len(data)) + data)
        except (BrokenPipeError, OSError) as exc:
            raise SessionError("the session's agent is gone") from exc

    def _receive(self, timeout: float) -> dict[str, object]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        # poll, not select: select() refuses a descriptor numbered 1024 or more, which a
        # long-lived host process (the web, a test run) reaches.
        poller = select.poll()
        poller.register(fd, select.POLLIN)

        def exact(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionError("the session's agent did not answer in time")
                if not poller.poll(left * 1000):
                    continue
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise SessionError("the session's agent is gone")
                buf += chunk
            return buf

        (size,) = struct.unpack(">I", exact(4))
        if size > 64 << 20:
            raise SessionError("the session's agent sent an oversized reply")
        reply = json.loads(exact(size))
        if not isinstance(reply, dict):
            raise SessionError("the session's agent sent a malformed reply")
        return reply

    def _call(self, request: dict[str, object], timeout: float) -> dict[str, object]:
        self._send(request)
        return self._receive(timeout)

    # -- the calls -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        with self._lock:
            if self.closed_reason is not None:
                raise SessionClosed(self.id, self.closed_reason)
            self._busy += 1
            try:
                yield None
            finally:
                self._busy -= 1
                self.last_used = time.monotonic()

    def _counters(self) -> tuple[int, int, int]:
        assert self.cgroup is not None
        return self.cgroup.cpu_ns(), self.cgroup.oom_kills(), self.cgroup.pids_max_hits()

    def exec(self, cmd: str | SessionExec, timeout: float = 30.0) -> ExecResult:
        """Run `bash -c cmd` in /work; returns when it exits (or at the timeout, when its
        process group is killed)."""
        req = cmd if isinstance(cmd, SessionExec) else SessionExec(cmd=cmd, timeout_s=timeout)
        with self._using():
            cpu0, oom0, pids0 = self._counters()
            request = {"op": "exec", "cmd": req.cmd, "timeout_ms": int(req.timeout_s * 1000),
                       "stdin": base64.b64encode(req.stdin.encode()).decode(),
                       "env": req.env, "background": req.background,
                       "output_bytes": req.output_bytes}
            try:
                reply = self._call(request, req.timeout_s + _REPLY_GRACE_S)
            except SessionError as exc:
                reason = self._ending or f"lost: {exc}"
                self._close_locked(reason)
                status = SessionStatus.CPU if reason.startswith("cpu") else SessionStatus.LOST
                return ExecResult(status=status, message=f"the session ended: {reason}")
            cpu1, oom1, pids1 = self._counters()
            result = self._result(reply, cpu1 - cpu0, oom1 > oom0, pids1 > pids0)
            if result.status == SessionStatus.PIDS:
                with contextlib.suppress(SessionError):
                    self._call({"op": "killall"}, 10.0)
            if cpu1 / 1e9 > self.limits.cpu_s:
                self._close_locked(f"cpu quota of {self.limits.cpu_s} s spent")
                result.status = SessionStatus.CPU
                result.message = (f"the session's CPU quota ({self.limits.cpu_s} s) is spent: "
                                  "the session is closed")
            return result

    def _result(self, reply: dict[str, object], cpu_ns: int, oom: bool,
                pids_hit: bool) -> ExecResult:
        if "pid" in reply:
            return ExecResult(status=SessionStatus.OK, pid=int(str(reply["pid"])),
                              cpu_ms=cpu_ns // 1_000_000)
        if reply.get("error") == "spawn":
            no = reply.get("errno")
            status = SessionStatus.PIDS if no == errno.EAGAIN or pids_hit else SessionStatus.RE
            if status == SessionStatus.PIDS:
                msg = (f"cannot start the command: the session's {self.limits.pids}-process "
                       "quota is reached")
            else:
                msg = f"cannot start the command: {reply.get('message')}"
            return ExecResult(status=status, message=msg)

        def text(key: str) -> bytes:
            return base64.b64decode(str(reply.get(key) or ""))

        code, sig = reply.get("exit_code"), reply.get("signal")
        result = ExecResult(
            status=SessionStatus.OK, exit_code=code if isinstance(code, int) else None,
            signal=sig if isinstance(sig, int) else None, stdout=text("stdout"),
            stderr=text("stderr"), stdout_truncated=bool(reply.get("stdout_truncated")),
            stderr_truncated=bool(reply.get("stderr_truncated")),
            wall_ms=int(str(reply.get("wall_ms", 0))), cpu_ms=cpu_ns // 1_000_000)
        failed = result.exit_code != 0
        if reply.get("timed_out"):
            result.status, result.message = SessionStatus.TLE, "the call's timeout: killed"
        elif reply.get("output_exceeded"):
            result.status, result.message = SessionStatus.OLE, "too much output: killed"
        elif oom and failed:
            result.status = SessionStatus.MLE
            result.message = (f"the session's memory quota ({self.limits.memory_mb} MiB) was "
                              "reached: the kernel killed a process of this command")
        elif pids_hit:
            result.status = SessionStatus.PIDS
            result.message = (f"the session's process quota ({self.limits.pids}) was reached: "
                              "every process of the session was killed (background ones too)")
        elif failed and self.disk_full():
            result.status = SessionStatus.DISK
            result.message = f"the workspace is full (disk quota {self.limits.disk_mb} MiB)"
        elif failed:
            result.status = SessionStatus.RE
        return result

    def disk_full(self) -> bool:
        st = os.statvfs(self.scratch)
        return st.f_bavail * st.f_frsize < (64 << 10) or st.f_favail == 0

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        with self._using():
            try:
                wspath.write(self.root, path, data, owner=(self.uid, self.uid), mode=mode)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise wspath.PathRefused(f"{path!r}: the workspace is full (disk quota "
                                             f"{self.limits.disk_mb} MiB)") from exc
                raise

    def read(self, path: str, limit: int = READ_LIMIT) -> bytes:
        with self._using():
            return wspath.read(self.root, path, limit=limit)

    def list(self, path: str = "") -> list[wspath.Entry]:
        with self._using():
            return wspath.listdir(self.root, path)

    def snapshot(self) -> str:
        """Freeze the session's processes, copy what changed into a new layer, thaw."""
        with self._using():
            assert self.freezer is not None
            layer = self.manager.new_layer_id()
            tmp = self.manager.layer_path(layer).with_name(f".{layer}")
            flatten = len(self.layers) + 1 > MAX_LAYERS
            prev = None if flatten or self._last_layer is None else \
                self.manager.layer_path(self._last_layer)
            with self.freezer.frozen():
                _copy_tree(self.root if flatten else self.scratch / "upper", tmp, prev)
            os.rename(tmp, self.manager.layer_path(layer))
            layers = (layer,) if flatten else (layer, *self.layers)
            self._last_layer = None if flatten else layer
            snap = Snapshot(id=secrets.token_hex(8), layers=layers, owner_uid=self.uid,
                            bytes=_tree_bytes(self.manager.layer_path(layer)))
            self.manager.add_snapshot(snap)
            return snap.id

    def restore(self, snapshot_id: str) -> None:
        """Roll the workspace back to a snapshot; running processes are stopped."""
        snap = self.manager.snapshot(snapshot_id)
        with self._using():
            old = self.layers
            self.manager.hold(snap.layers)
            try:
                self._stop_processes()
                self._unmount_workspace()
                self._mount_workspace(snap.layers, snap.owner_uid)
                self._start_agent()
            except BaseException:
                self._close_locked("lost: the restore failed")
                raise
            finally:
                self.manager.release(old)

    def fork(self, snapshot_id: str | None = None,
             limits: SessionLimits | None = None) -> Session:
        """A new session on a snapshot of this one (taken now unless given), with this one's
        egress policy."""
        return self.manager.fork(snapshot_id or self.snapshot(), limits or self.limits,
                                 egress=self.egress)

    def egress_log(self) -> dict[str, object]:
        """The egress proxy's decisions (allowed, refused, failed; host, port, address, rule,
        bytes), oldest first, with totals; an empty log where the session has no policy."""
        if self.proxy is None:
            return {"policy": None, "decisions": [], "stats": {}}
        return {"policy": self.proxy.policy.model_dump(), "decisions": self.proxy.log(),
                "stats": self.proxy.stats()}

    def usage(self) -> dict[str, int]:
        assert self.cgroup is not None
        st = os.statvfs(self.scratch)
        return {"cpu_ms": self.cgroup.cpu_ns() // 1_000_000,
                "memory_peak_bytes": self.cgroup.peak_memory(),
                "processes": len(self.cgroup.procs()),
                "disk_used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize,
                "disk_bytes": st.f_blocks * st.f_frsize}

    def close(self, reason: str = "closed") -> None:
        with self._lock:
            self._close_locked(reason)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_locked(self, reason: str) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        self._teardown()
        self.manager.forget(self)

    def _expire(self, reason: str) -> None:
        """From the watchdog: kill at once (an exec in flight then reports the reason), and
        close once no call holds the session."""
        self._ending = reason
        if self.cgroup is not None:
            with contextlib.suppress(OSError, cgroups.CgroupError):
                self.cgroup.signal_all()
        if self._lock.acquire(timeout=0.1):
            try:
                self._close_locked(reason)
            finally:
                self._lock.release()


class _Done:
    """A future-like result computed on the spot (fork_many of one fork)."""

    def __init__(self, fn: Callable[[int], Session], i: int) -> None:
        self._value: Session | None = None
        self._error: BaseException | None = None
        try:
            self._value = fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self) -> Session:
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class SessionManager:
    """Sessions, snapshots and layers of one process; a watchdog thread enforces lifetimes,
    idle timeouts and CPU quotas."""

    def __init__(self, watch_every_s: float = 0.25,
                 egress_open: tuple[egress_proxy.Network, ...] | None = None) -> None:
        """`egress_open`: networks sessions' proxies may reach although they are not public
        (the operator's setting, CRUCIBLE_SESSION_EGRESS_OPEN by default; tests open
        127.0.0.0/8 for their local servers)."""
        self.egress_open = (egress_proxy.open_networks_from_env() if egress_open is None
                            else tuple(egress_open))
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # recent closes: id -> reason
        self._refs: dict[str, int] = {}  # layer -> snapshots and sessions using it
        self.layers_dir = BASE / "layers"
        self.layers_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        (BASE / "s").mkdir(exist_ok=True, mode=0o711)
        sweep_orphans()
        os.chmod(BASE, 0o711)
        self._empty = self.layers_dir / "empty"
        self._empty.mkdir(exist_ok=True, mode=0o755)
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-spawn")
        # pre-started blank sandboxes per (limits, network), kept at the asked count
        self._warm: dict[tuple[str, bool], list[Session]] = {}
        self._warm_target: dict[tuple[str, bool], int] = {}
        self._warm_pending: dict[tuple[str, bool], int] = {}
        self._warmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-warm")
        self._stop = threading.Event()
        self._watch_every = watch_every_s
        self._watchdog = threading.Thread(target=self._watch, name="session-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def spawn(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """Run `start` (a Popen) on the manager's spawning thread, which lives as long as the
        manager: a session's sandbox dies with the thread that forked it."""
        return self._spawner.submit(start).result()

    # pre-started sandboxes -------------------------------------------------------------------

    @staticmethod
    def _warm_key(limits: SessionLimits, inet: bool) -> tuple[str, bool]:
        return limits.model_dump_json(), inet

    def keep_warm(self, limits: SessionLimits, n: int, *, egress: bool = False) -> None:
        """Keep `n` sandboxes with these limits (and the egress policy's network, when
        `egress`) started ahead, so that `fork` and `fork_many` skip the sandbox's and its
        agent's start-up: they mount the workspace into a running sandbox. Filled and
        refilled in the background; `n=0` stops it. Each costs what an idle session does
        (≈11 MB, a uid, a cgroup)."""
        if not 0 <= n <= 256:
            raise ValueError(f"keep_warm keeps 0 to 256 sandboxes, not {n}")
        key = self._warm_key(limits, egress)
        with self._lock:
            self._warm_target[key] = n
            extra = self._warm.get(key, [])[n:]
            self._warm[key] = self._warm.get(key, [])[:n]
        for blank in extra:
            blank.close("not needed")
        self._refill(key, limits)

    def wait_warm(self, timeout: float = 30.0) -> bool:
        """Whether every pool reached its count within `timeout` (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(len(self._warm.get(k, [])) >= n for k, n in self._warm_target.items()):
                    return True
            time.sleep(0.01)
        return False

    def _refill(self, key: tuple[str, bool], limits: SessionLimits) -> None:
        with self._lock:
            missing = (self._warm_target.get(key, 0) - len(self._warm.get(key, []))
                       - self._warm_pending.get(key, 0))
            if missing <= 0 or self._stop.is_set():
                return
            self._warm_pending[key] = self._warm_pending.get(key, 0) + missing

        def make() -> None:
            try:
                blank = Session(self, limits, (), None, blank=True, inet=key[1])
            except (SessionError, OSError, cgroups.CgroupError):
                with self._lock:
                    self._warm_pending[key] -= 1
                return
            with self._lock:
                self._warm_pending[key] -= 1
                if not self._stop.is_set() and \
                        len(self._warm.get(key, [])) < self._warm_target.get(key, 0):
                    self._warm.setdefault(key, []).append(blank)
                    blank = None  # type: ignore[assignment]
            if blank is not None:
                blank.close("not needed")

        for _ in range(missing):
            with contextlib.suppress(RuntimeError):  # the manager is closing
                self._warmer.submit(make)

    def _take_warm(self, limits: SessionLimits, inet: bool, n: int) -> list[Session]:
        key = self._warm_key(limits, inet)
        with self._lock:
            pool = self._warm.get(key, [])
            taken, self._warm[key] = pool[:n], pool[n:]
        live = []
        for blank in taken:  # one whose agent died while it waited is dropped
            if blank.proc is not None and blank.proc.poll() is None:
                live.append(blank)
            else:
                blank.close("lost while pre-started")
        if key in self._warm_target:
            self._refill(key, limits)
        return live

    # layers ------------------------------------------------------------------------------------

    def new_layer_id(self) -> str:
        return f"{os.getpid()}-{secrets.token_hex(6)}"

    def layer_path(self, layer: str) -> Path:
        return self.layers_dir / layer

    def empty_layer(self) -> Path:
        return self._empty

    def hold(self, layers: tuple[str, ...]) -> None:
        with self._lock:
            for layer in layers:
                self._refs[layer] = self._refs.get(layer, 0) + 1

    def release(self, layers: tuple[str, ...]) -> None:
        dead = []
        with self._lock:
            for layer in layers:
                self._refs[layer] = self._refs.get(layer, 1) - 1
                if self._refs[layer] <= 0:
                    del self._refs[layer]
                    dead.append(layer)
        for layer in dead:
            shutil.rmtree(self.layer_path(layer), ignore_errors=True)

    # snapshots ---------------------------------------------------------------------------------

    def add_snapshot(self, snap: Snapshot) -> None:
        self.hold(snap.layers)
        with self._lock:
            self.snapshots[snap.id] = snap

    def snapshot(self, snapshot_id: str) -> Snapshot:
        with self._lock:
            snap = self.snapshots.get(snapshot_id)
        if snap is None:
            raise UnknownSnapshot(snapshot_id)
        return snap

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Forget a snapshot; its layers go once no session or snapshot uses them."""
        with self._lock:
            snap = self.snapshots.pop(snapshot_id, None)
        if snap is None:
            raise UnknownSnapshot(snapshot_id)
        self.release(snap.layers)

    # sessions ----------------------------------------------------------------------------------

    def create(self, limits: SessionLimits | None = None,
               files: dict[str, bytes] | None = None, binds: Binds = (),
               egress: EgressPolicy | None = None) -> Session:
        """A new empty session; with `egress`, outbound HTTP(S) through its allow-listed
        proxy (and nothing else), without it no network at all."""
        session = Session(self, limits or SessionLimits(), (), None, binds, egress)
        with self._lock:
            self.sessions[session.id] = session
        try:
            for path, data in (files or {}).items():
                session.write(path, data)
        except BaseException:
            session.close("failed to start")
            raise
        return session

    def fork(self, snapshot_id: str, limits: SessionLimits | None = None,
             binds: Binds = (), egress: EgressPolicy | None = None) -> Session:
        """A new session on a snapshot (nothing copied); a fork's network is its own
        `egress` policy, never the snapshot's source's."""
        return self.fork_many(snapshot_id, 1, limits, binds, egress)[0]

    def fork_many(self, snapshot_id: str, n: int, limits: SessionLimits | None = None,
                  binds: Binds | Callable[[int], Binds] = (),
                  egress: EgressPolicy | None = None) -> list[Session]:
        """`n` forks of one snapshot (a GRPO group) made side by side: the forks' set-ups
        (cgroup, mounts, spawning the sandbox, re-owning the inherited files: syscalls that
        release the GIL) run on a few threads, and every agent's interpreter starts while the
        next forks are being set up; then each agent is waited for. `binds` may be a function
        of the fork's index (one agent socket per episode). All or nothing: if one fork
        fails, the others are closed and the error raised. Order of the result = index."""
        if not 1 <= n <= 256:
            raise ValueError(f"fork_many makes 1 to 256 forks, not {n}")
        snap = self.snapshot(snapshot_id)
        limits = limits or SessionLimits()
        warm = self._take_warm(limits, egress is not None, n)

        def one(i: int) -> Session:
            lend = binds(i) if callable(binds) else binds
            self.hold(snap.layers)
            try:
                if i < len(warm):  # a pre-started sandbox: mount the workspace into it
                    session = warm[i]
                    session.adopt(snap.layers, snap.owner_uid, lend, egress)
                else:
                    session = Session(self, limits, snap.layers, snap.owner_uid, lend, egress,
                                      wait=False)
            except BaseException:
                self.release(snap.layers)
                raise
            with self._lock:
                self.sessions[session.id] = session
            return session

        futures: list[_Done] | list[Future[Session]]
        if n == 1:  # no thread for a single fork
            futures = [_Done(one, 0)]
        else:
            with ThreadPoolExecutor(max_workers=min(n, _FORK_THREADS),
                                    thread_name_prefix="fork-many") as pool:
                futures = [pool.submit(one, i) for i in range(n)]
        started: list[Session] = []
        error: BaseException | None = None
        for fut in futures:
            try:
                started.append(fut.result())
            except BaseException as exc:  # noqa: BLE001 - the first is raised below
                error = error or exc
        if error is not None:
            for session in started:
                session.close("failed to start")
            raise error
        try:
            for session in started[len(warm):]:
                session.finish_start()
        except BaseException:
            for session in started:
                session.close("failed to start")
            raise
        return started

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            with self._lock:
                reason = self._closed.get(session_id, "unknown or closed")
            raise SessionClosed(session_id, reason)
        return session

    def forget(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.id, None)
            self._closed[session.id] = session.closed_reason or "closed"
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
        self.release(session.layers)

    def _watch(self) -> None:
        while not self._stop.wait(self._watch_every):
            now = time.monotonic()
            with self._lock:
                live = list(self.sessions.values())
            for s in live:
                reason = None
                with contextlib.suppress(OSError, AssertionError):
                    if s.cgroup is not None and s.cgroup.cpu_ns() / 1e9 > s.limits.cpu_s:
                        reason = f"cpu quota of {s.limits.cpu_s} s spent"
                if reason is None and now - s.created > s.limits.wall_s:
                    reason = f"expired: lifetime of {s.limits.wall_s} s"
                if reason is None and not s._busy and now - s.last_used > s.limits.idle_s:
                    reason = f"idle for {s.limits.idle_s} s"
                if reason is not None:
                    s._expire(reason)

    def close(self) -> None:
        """Close every session and drop every snapshot of this manager."""
        self._stop.set()
        with self._lock:
            live = list(self.sessions.values())
            snaps = list(self.snapshots)
        with self._lock:
            blanks = [b for pool in self._warm.values() for b in pool]
            self._warm.clear()
        self._warmer.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # made while shutting down
            blanks += [b for pool in self._warm.values() for b in pool]
            self._warm.clear()
        for s in [*live, *blanks]:
            s.close("manager closed")
        for snap_id in snaps:
            with contextlib.suppress(UnknownSnapshot):
                self.drop_snapshot(snap_id)
        self._spawner.shutdown(wait=False)

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep_orphans() -> None:
    """Unmount and delete what sessions of dead processes left behind (a SIGKILLed host)."""
    for entry in (BASE / "s").glob("*-*"):
        pid = entry.name.split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            for sub in ("root", "root", "scratch", "crucible"):  # root: overlay, then bind
                with contextlib.suppress(SessionError):
                    _umount(entry / sub)
            shutil.rmtree(entry, ignore_errors=True)
    for lent in (BASE / "agent").glob("*-*"):  # agent_proxy's per-episode folders
        pid = lent.name.split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(lent, ignore_errors=True)
    for layer in (BASE / "layers").glob("*-*"):
        pid = layer.name.lstrip(".").split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(layer, ignore_errors=True)

