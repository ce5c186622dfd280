"""One sandboxed process: spawn under bubblewrap in its own cgroup, feed it, watch it, kill it.

Start-up order matters. The process must be in its cgroup before it can fork, so the child first
runs a "gate" that blocks reading a line from its stdin; the supervisor moves it into the cgroup
and writes that line; the gate lowers its rlimits (root here lacks CAP_SYS_RESOURCE, so limits
cannot be set from outside), drops to the unprivileged sandbox uid (a root-started bwrap would
keep real uid 0) and execs bwrap. The gate is a small static executable (`harness/gate.c`, see
gate.py); where it cannot be built, a shell (dash where present) with `ulimit` and setpriv does
the same in three process images. Dropping privileges in the child's exec chain rather than in
Popen keeps Popen on vfork (Python forks for Popen(user=...)), which matters when the supervisor
is a large worker process.

The supervisor is a child subreaper, so a sandbox orphaned by a kill is re-parented to it and
reaped here rather than lingering as a zombie charged to pids.max.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import secrets
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import cgroups, gate, records
from .harness import source as harness_source
from .policy import bwrap, seccomp
from .spec import Limits

BASH = "/bin/bash"
DASH = "/usr/bin/dash"  # Debian's /bin/sh: starts in about half the CPU time of bash
SETPRIV = "/usr/bin/setpriv"
PERL = "/usr/bin/perl"
_PR_SET_CHILD_SUBREAPER = 36

_tracked: set[int] = set()
_tracked_lock = threading.Lock()
_subreaper_done = False


def memfd(data: bytes, name: str) -> int:
    """A fresh fd holding `data`, positioned at its start, for a sandbox to read."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def track(pid: int) -> None:
    """Mark a sandbox process another module waits for itself (sessions): sweeps skip it."""
    with _tracked_lock:
        _tracked.add(pid)


def untrack(pid: int) -> None:
    with _tracked_lock:
        _tracked.discard(pid)


class SandboxError(RuntimeError):
    """The engine could not run the sandbox (not the program's fault)."""


def become_subreaper() -> None:
    """Adopt orphaned descendants, so killed sandboxes are reaped here (once per process)."""
    global _subreaper_done
    if not _subreaper_done:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
        _subreaper_done = True


def _settled(pid: int) -> bool:
    """True once a dead sandbox process no longer needs us: reaped here, or gone from /proc, or
    the pid now belongs to some live unrelated process. False while it is a zombie whose parent
    is still exiting (it will be re-parented to this subreaper in a moment)."""
    with _tracked_lock:
        if pid in _tracked:
            return True  # a live Popen of ours: its owner waits for it
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return bool(done)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def _ours(comm: str) -> bool:
    """Whether a process of this name is one the engine starts: bwrap (and the helpers it forks
    during set-up), or the status waiter (PID 1 of a sandbox, re-parented to this subreaper
    when bwrap is killed first): the static one's name is its file name, cut to 15 bytes."""
    if comm == "bwrap" or comm.startswith("waiter-"):
        return True
    return comm == "perl" and gate.waiter_binary() is None  # the Perl waiter, where in use


def _orphans() -> dict[int, str]:
    """Untracked children of this process that the engine started (see _ours), by state."""
    me = os.getpid()
    children: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{me}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{me}/task/{tid}/children") as fh:
                children.update(int(p) for p in fh.read().split())
    with _tracked_lock:
        children -= _tracked
    found: dict[int, str] = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                comm, _, rest = fh.read().partition("(")[2].rpartition(")")
        except OSError:
            continue
        if _ours(comm):
            found[pid] = rest.split()[0]
    return found


def sweep() -> int:
    """Reap untracked zombie children the engine started (see _ours): set-up helpers a bwrap
    had not reaped when it was killed, and status waiters whose bwrap died first. Only this
    engine starts them in this process, and live Popens are skipped, so nothing another
    component waits for is taken."""
    reaped = 0
    for pid, state in _orphans().items():
        if state == "Z":
            with contextlib.suppress(ChildProcessError):
                reaped += bool(os.waitpid(pid, os.WNOHANG)[0])
    return reaped


_SWEEP_EVERY_S = 1.0
_TRAILING_FOR_S = 60.0
_last_sweep = [0.0]
_last_request = [0.0]
_trailing = [False]


def _sweep_now_and_then() -> None:
    """Sweep at most once a second from teardown: listing every thread's children costs more
    than the rest of a teardown, and the zombies it looks for are rare; one that keeps a
    cgroup from being removed is swept at once (Cgroup.remove's on_busy). Trailing sweeps
    follow the last teardown, so an orphan still dying when it ran (a waiter a killed bwrap
    had just forked, dying of its parent-death signal) is not left a zombie."""
    now = time.monotonic()
    with _tracked_lock:
        due = now - _last_sweep[0] >= _SWEEP_EVERY_S
        if due:
            _last_sweep[0] = now
        _last_request[0] = now
        start_trailing = not _trailing[0]
        _trailing[0] = True
    if due:
        sweep()
    if start_trailing:
        threading.Thread(target=_trailing_sweeps, name="sandbox-sweep", daemon=True).start()


def _trailing_sweeps() -> None:
    """Sweep once a second until a sweep at least a second after the last teardown finds no
    orphan of ours left; give up on one that lingers _TRAILING_FOR_S (the next teardown
    starts watching again)."""
    while True:
        time.sleep(_SWEEP_EVERY_S)
        swept_at = time.monotonic()
        with _tracked_lock:
            _last_sweep[0] = swept_at
        sweep()
        left = _orphans()
        with _tracked_lock:
            since = swept_at - _last_request[0]
            if (not left and since >= _SWEEP_EVERY_S) or since > _TRAILING_FOR_S:
                _trailing[0] = False
                return


def reap(pids: set[int], timeout: float = 2.0) -> set[int]:
    """Reap sandbox processes re-parented to this subreaper (typically bwrap's init of the PID
    namespace, when its parent was killed first); waits briefly for re-parenting to finish.
    Returns the pids still unsettled at the timeout."""
    pending = set(pids)
    deadline = time.monotonic() + timeout
    while pending:
        pending = {pid for pid in pending if not _settled(pid)}
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    return pending


def gate_argv(limits: Limits, cpu_ms: int | None, uid: int) -> list[str]:
    """The command that waits for the cgroup, lowers the rlimits, drops privileges to `uid`
    (and the gid of the same number) and execs the argv appended to it: the compiled gate, or
    the shell + setpriv fallback."""
    cpu_s = math.ceil((cpu_ms if cpu_ms is not None else limits.cpu_ms) / 1000) + 1
    binary = gate.gate_binary()
    if binary is not None:
        return [binary, str(cpu_s), str(limits.file_size_mb << 20), str(limits.open_files),
                str(uid), str(uid)]
    shell, fsize_unit = gate_shell()
    return [shell, "-c", gate_script(limits, cpu_ms, fsize_unit, uid), "gate"]


def waiter_argv(argv: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """argv under the status waiter (PID 1: reports the program's real wait status in a keyed
    record), with the bind that makes the waiter visible inside if it needs one. The static
    waiter where it could be built, else the Perl one (perl-base is Essential on Debian)."""
    inside = gate.waiter_inside()
    if inside is not None:
        mount = gate.waiter_mount()
        return [inside, "{STATUS_FD}", "{KEY_FD}", *argv], ((mount,) if mount else ())
    if not os.access(PERL, os.X_OK):
        raise SandboxError("neither the static status waiter nor perl is available: run "
                           "scripts/install_sandbox_deps.sh")
    return [PERL, "-e", harness_source("status_waiter.pl"), "{STATUS_FD}", "{KEY_FD}",
            *argv], ()


def gate_shell() -> tuple[str, int]:
    """(shell, bytes per `ulimit -f` unit): dash counts 512-byte blocks, bash kilobytes."""
    return (DASH, 512) if os.access(DASH, os.X_OK) else (BASH, 1024)


def gate_script(limits: Limits, cpu_ms: int | None, fsize_unit: int, uid: int) -> str:
    """The gate: wait for the line that says the process is in its cgroup, lower the rlimits
    (hard and soft: the program cannot raise them again), drop to the sandbox uid and exec bwrap.
    The process lowers its own limits because root here lacks CAP_SYS_RESOURCE, so prlimit on a
    process of another uid is refused. One limit per `ulimit` (dash takes no more)."""
    cpu_s = math.ceil((cpu_ms if cpu_ms is not None else limits.cpu_ms) / 1000) + 1
    fsize = (limits.file_size_mb << 20) // fsize_unit
    return (
        "read -r _ || exit 125; "
        f"ulimit -t {cpu_s} && ulimit -f {fsize} && ulimit -n {limits.open_files} && "
        "ulimit -c 0 || exit 125; "
        f"exec {SETPRIV} --reuid={uid} --regid={uid} --clear-groups "
        '--inh-caps=-all -- "$@"'
    )


@dataclass
class Outcome:
    """Raw facts about a finished sandboxed process, before they become a PhaseResult."""

    returncode: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    feedback: list[tuple[str, str]] = field(default_factory=list)  # the bootstrap's records
    feedback_error: str = ""  # the feedback channel was flooded or malformed
    timed_out: bool = False
    cpu_exceeded: bool = False
    output_exceeded: bool = False
    oom_killed: bool = False
    signal: int | None = None  # set only when reported by the status waiter (exit_reported)
    exit_reported: bool = False  # the waiter's keyed record gave the exact status
    cpu_ms: int = 0
    wall_ms: int = 0
    supervisor_cpu_ms: float = 0.0
    peak_memory_bytes: int = 0
    extra: dict[str, object] = field(default_factory=dict)


Status = tuple[int | None, int | None]


def parse_status(kind: str, value: str) -> Status | None:
    """(exit code, signal) from the waiter's `EXIT <n>` / `SIGNAL <n>` record."""
    if not value.isdigit() or len(value) > 3:
        return None
    if kind == "EXIT":
        return int(value) & 0xFF, None
    if kind == "SIGNAL" and 0 < int(value) < 128:
        return None, int(value)
    return None


def feedback_cap(extra_bytes: int = 0) -> int:
    """Bytes a bootstrap's feedback channel may carry: its small records plus a trace."""
    return records.MAX_BYTES + 2 * extra_bytes


class SandboxProcess:
    """A bwrap sandbox running `argv` on `workdir` as host `uid`; single use: spawn, run(),
    destroy().

    With `waiter` (the default for everything but compilers), argv runs under the status
    waiter, PID 1 of the sandbox, which reports the program's wait status in a record carrying
    a fresh key on a channel only it holds; the run ends on that record. `with_control` adds the
    bootstraps' control pipe (request in) and feedback pipe (READY, TRACE out); `links` are two
    more fds (read end, write end) handed in as {LINK_IN} / {LINK_OUT}: the pipes between a
    candidate and its test driver."""

    def __init__(
        self,
        *,
        argv: list[str],
        workdir: Path,
        limits: Limits,
        uid: int,
        env: dict[str, str] | None = None,
        ro_binds: tuple[tuple[str, str], ...] = (),
        with_control: bool = False,
        cpu_backstop_ms: int | None = None,
        waiter: bool = True,
        data: bytes | None = None,
        links: tuple[int, int] | None = None,
        feedback_bytes: int | None = None,
    ) -> None:
        tools = [bwrap.BWRAP] if gate.gate_binary() else [bwrap.BWRAP, SETPRIV, gate_shell()[0]]
        for tool in tools:
            if not os.access(tool, os.X_OK):
                raise SandboxError(f"{tool} is missing: run scripts/install_sandbox_deps.sh "
                                   "(apt-get install bubblewrap util-linux bash)")
        become_subreaper()
        self.limits = limits
        self.workdir = workdir
        self.uid = uid
        self.clean = False  # destroy() emptied and removed the cgroup: the uid is free again
        self._on_clean: list[Callable[[], None]] = []
        self._fds: list[int] = []
        self._seen: set[int] = set()
        self._accounted = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = secrets.token_bytes(records.KEY_BYTES)
        self.feedback_bytes = feedback_bytes or feedback_cap()
        self.feedback_r: int | None = None
        self.status_r: int | None = None
        self.cgroup = cgroups.create(memory_bytes=limits.memory_mb << 20, pids=limits.pids)
        try:
            self._spawn(argv, env or {}, ro_binds, with_control, cpu_backstop_ms, waiter, data,
                        links)
        except BaseException:
            self.destroy()
            raise

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self._fds += [r, w]
        return r, w

    def _spawn(
        self, argv: list[str], env: dict[str, str], ro_binds: tuple[tuple[str, str], ...],
        with_control: bool, cpu_backstop_ms: int | None, waiter: bool,
        data: bytes | None, links: tuple[int, int] | None,
    ) -> None:
        child_fds: list[int] = []

        def hand_in(placeholder: str, fd: int) -> None:
            nonlocal argv
            child_fds.append(fd)
            argv = [a.replace(placeholder, str(fd)) for a in argv]

        if waiter:
            argv, extra_binds = waiter_argv(argv)
            ro_binds = (*ro_binds, *extra_binds)
            self.status_r, st_w = self._pipe()
            hand_in("{STATUS_FD}", st_w)
            key_fd = memfd(self.key, "crucible-key")
            self._fds.append(key_fd)
            hand_in("{KEY_FD}", key_fd)
        self.control_w: int | None = None
        if with_control:
            self.feedback_r, fb_w = self._pipe()
            hand_in("{FEEDBACK_FD}", fb_w)
            ctl_r, self.control_w = self._pipe()
            hand_in("{CONTROL_FD}", ctl_r)
        if links is not None:
            hand_in("{LINK_IN}", links[0])
            hand_in("{LINK_OUT}", links[1])
        else:
            argv = [a.replace("{LINK_IN}", "-1").replace("{LINK_OUT}", "-1") for a in argv]
        if data is not None:  # read-only data for the sandbox (the precompiled bootstrap)
            data_fd = memfd(data, "crucible-data")
            self._fds.append(data_fd)
            hand_in("{DATA_FD}", data_fd)
        sec_fd = seccomp.filter_fd()
        self._fds.append(sec_fd)
        child_fds.append(sec_fd)
        inner = bwrap.command(
            workdir=self.workdir, argv=argv, env=env, seccomp_fd=sec_fd,
            tmpfs_bytes=self.limits.tmpfs_mb << 20, ro_binds=ro_binds, as_pid_1=waiter,
        )
        # RLIMIT_CPU is only a backstop: the supervisor watches the cgroup's CPU time itself.
        try:
            self.proc = subprocess.Popen(
                [*gate_argv(self.limits, cpu_backstop_ms, self.uid), *inner],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=child_fds, env={"PATH": bwrap.PATH}, cwd="/",
            )
        except OSError as exc:
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        with _tracked_lock:
            _tracked.add(self.proc.pid)
        for fd in child_fds:  # the child holds its ends now (the link fds are the caller's)
            if links is None or fd not in links:
                self._close(fd)
        self.cgroup.add(self.proc.pid)
        # Opens the gate: it reads exactly this line (byte by byte, from a pipe), so the
        # program's own stdin, written later on the same pipe, reaches the program intact.
        assert self.proc.stdin is not None
        os.write(self.proc.stdin.fileno(), b"go\n")

    def _close(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.remove(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def _children(self) -> set[int]:
        """Children of the outer bwrap, zombies included: an exited namespace init is no longer
        listed in the cgroup, but is re-parented to us (and must be reaped) if bwrap dies first."""
        if self.proc is None:
            return set()
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                return {int(p) for p in fh.read().split()}
        except OSError:
            return set()

    def wait_feedback(self, timeout: float) -> bool:
        """Whether the feedback pipe has something to read (or was closed) within timeout,
        without reading it: a warm bootstrap's READY record stays there for run() to skip."""
        if self.feedback_r is None:
            return True
        poller = select.poll()
        poller.register(self.feedback_r, select.POLLIN)
        return bool(poller.poll(max(timeout, 0.0) * 1000))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def relimit(self, limits: Limits) -> None:
        """Apply a request's cgroup limits to an already started (warm) sandbox; its rlimits
        were fixed at spawn, so the pool only serves requests whose rlimits match."""
        self.limits = limits
        self.cgroup.set_limits(memory_bytes=limits.memory_mb << 20, pids=limits.pids)
        self.cgroup.reset_peak()

    def send_control(self, data: bytes) -> None:
        """Hand the request to a bootstrap waiting on the control pipe, then close it."""
        if self.control_w is None:
            raise SandboxError("this sandbox has no control pipe")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.control_w, view):]
        except BrokenPipeError as exc:
            raise SandboxError("the warm sandbox died before it got its request") from exc
        finally:
            self._close(self.control_w)
            self.control_w = None

    def run(self, stdin: bytes = b"", *, control: bytes | None = None) -> Outcome:
        """Feed stdin, collect output within the limits, and return when the program is done.

        Done means the status waiter's keyed record arrived (the program is gone and its output
        is in the pipes, so the sandbox is killed here rather than waited for: namespace
        teardown stays off the critical path), or the sandbox exited. Nothing the program
        writes can end the run early: it holds neither the status channel nor its key. The
        supervisor's own CPU time on this run (this thread's) is reported and counted against
        the CPU limit, so flooding the pipes costs the program, not the host."""
        assert self.proc is not None and self.proc.stdin and self.proc.stdout and self.proc.stderr
        limits = self.limits
        out = Outcome()
        thread_cpu0 = time.thread_time_ns()
        cpu0 = self.cgroup.cpu_ns()
        start = time.monotonic()
        if control is not None:
            self.send_control(control)
        deadline = start + limits.wall_ms / 1000
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        feedback = records.RecordReader(max_bytes=self.feedback_bytes)
        status = records.RecordReader(key=self.key, max_records=4, max_bytes=256)

        def take(name: str, chunk: bytes) -> None:
            if name == "feedback":
                feedback.feed(chunk)
                return
            if name == "status":
                status.feed(chunk)
                return
            buf = bufs[name]
            room = limits.output_bytes - len(bufs["stdout"]) - len(bufs["stderr"])
            buf += chunk[: max(room, 0)]
            if len(chunk) > room:
                setattr(out, f"{name}_truncated", True)
                out.output_exceeded = True

        def spent_ms() -> float:
            return ((self.cgroup.cpu_ns() - cpu0) + (time.thread_time_ns() - thread_cpu0)) / 1e6

        sel = selectors.DefaultSelector()
        pidfd = os.pidfd_open(self.proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        channels = [("stdout", self.proc.stdout.fileno()), ("stderr", self.proc.stderr.fileno())]
        if self.feedback_r is not None:
            channels.append(("feedback", self.feedback_r))
        if self.status_r is not None:
            channels.append(("status", self.status_r))
        for name, fd in channels:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, name)
        stdin_fd = self.proc.stdin.fileno()
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
        else:
            self.proc.stdin.close()
        exited_at: float | None = None
        reported: Status | None = None
        try:
            while reported is None and not out.output_exceeded and not feedback.stopped:
                readers = [k for k in sel.get_map().values() if k.data not in ("exit", "stdin")]
                if exited_at is not None and not readers:
                    break
                now = time.monotonic()
                if exited_at is not None and now - exited_at > 0.5:
                    break  # pipes held open by nothing we can still wait for
                if now >= deadline:
                    out.timed_out = True
                    break
                if spent_ms() > limits.cpu_ms:
                    out.cpu_exceeded = True
                    break
                for key, _ in sel.select(min(deadline - now, 0.1)):
                    name = key.data
                    if name == "exit":
                        sel.unregister(pidfd)
                        exited_at = time.monotonic()
                        # nothing may outlive the program (daemons)
                        self._seen |= self._children() | self.cgroup.signal_all()
                    elif name == "stdin":
                        try:
                            pending = pending[os.write(stdin_fd, pending[:65536]):]
                        except BrokenPipeError:
                            pending = memoryview(b"")
                        except BlockingIOError:
                            continue
                        if not pending:
                            sel.unregister(stdin_fd)
                            self.proc.stdin.close()
                    else:
                        chunk = b""
                        with contextlib.suppress(BlockingIOError):
                            chunk = os.read(key.fd, 65536)
                        if not chunk:
                            sel.unregister(key.fd)
                            continue
                        take(name, chunk)
                        if name == "status" and status.records:
                            reported = parse_status(*status.records[0])
            if reported is not None:
                # The program is gone: drain what it left in the pipes (bounded by the caps).
                for key in list(sel.get_map().values()):
                    if key.data in ("stdout", "stderr", "feedback"):
                        with contextlib.suppress(BlockingIOError, OSError):
                            while not out.output_exceeded and (chunk := os.read(key.fd, 65536)):
                                take(key.data, chunk)
        finally:
            sel.close()
            os.close(pidfd)
        out.wall_ms = int((time.monotonic() - start) * 1000)
        self._seen |= self._children() | self.cgroup.signal_all()
        if reported is None:
            out.returncode = self._wait()
            if self.status_r is not None:  # the waiter may have reported as it was killed
                with contextlib.suppress(OSError):
                    while (chunk := os.read(self.status_r, 4096)) and not status.stopped:
                        status.feed(chunk)
                reported = parse_status(*status.records[0]) if status.records else None
        if reported is not None:
            code, signal_no = reported
            out.returncode = code if code is not None else 128 + (signal_no or 0)
            out.signal = signal_no
            out.exit_reported = True
        if feedback.stopped:
            out.feedback_error = feedback.malformed or "the feedback channel was flooded"
        out.feedback = feedback.records
        out.cpu_ms = int((self.cgroup.cpu_ns() - cpu0) / 1e6)
        out.supervisor_cpu_ms = (time.thread_time_ns() - thread_cpu0) / 1e6
        out.cpu_exceeded = out.cpu_exceeded or out.cpu_ms + out.supervisor_cpu_ms > limits.cpu_ms
        out.peak_memory_bytes = self.cgroup.peak_memory()
        out.oom_killed = self.cgroup.oom_kills() > 0
        out.stdout, out.stderr = bytes(bufs["stdout"]), bytes(bufs["stderr"])
        return out

    def _wait(self) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def destroy(self) -> None:
        """Kill everything in the cgroup, reap, remove the cgroup; safe to call twice. Sets
        `clean` once the cgroup is gone: no process of this sandbox's uid is left."""
        self._seen |= self._children()
        with contextlib.suppress(OSError, cgroups.CgroupError):
            self._seen |= self.cgroup.kill()
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGKILL)
                self._wait()
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            with _tracked_lock:
                _tracked.discard(self.proc.pid)
        for fd in list(self._fds):
            self._close(fd)
        leftover = reap(self._seen)
        _sweep_now_and_then()
        if not self._accounted:
            self._accounted = True
            with contextlib.suppress(OSError, ValueError):
                _account(self.cgroup.cpu_ns())
        try:
            # A zombie the reaps above missed keeps a v1 cgroup busy: sweep then, at once.
            self.cgroup.remove(on_busy=sweep)
        except OSError:
            return
        if not leftover:
            self._now_clean()
        else:  # re-parenting is slow on a loaded host: finish reaping in the background
            _later(lambda: self._now_clean() if not reap(leftover, 30.0) else None)

    def _now_clean(self) -> None:
        with _tracked_lock:
            self.clean = True
            hooks, self._on_clean = self._on_clean, []
        for hook in hooks:
            hook()

    def when_clean(self, hook: Callable[[], None]) -> None:
        """Run `hook` once no process of this sandbox is left (at once if none is): the time to
        give its uid back."""
        with _tracked_lock:
            if not self.clean:
                self._on_clean.append(hook)
                return
        hook()


_usage_lock = threading.Lock()
_usage = [0, 0]  # CPU ns of every destroyed sandbox of this process, and how many


def _account(cpu_ns: int) -> None:
    with _usage_lock:
        _usage[0] += cpu_ns
        _usage[1] += 1


def sandbox_usage() -> tuple[int, int]:
    """(CPU ns, count) of the sandboxes this process has destroyed: everything charged to their
    cgroups, from the gate's move into the cgroup to the last process's exit. Unlike the
    parent cgroup's counter it excludes sandboxes of other engines on the same host."""
    with _usage_lock:
        return _usage[0], _usage[1]


_teardown: ThreadPoolExecutor | None = None
_teardown_lock = threading.Lock()


class _Destroyable(Protocol):
    def destroy(self) -> None: ...


def _later(work: Callable[[], object]) -> None:
    global _teardown
    with _teardown_lock:
        if _teardown is None:
            _teardown = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-teardown")
        _teardown.submit(work)


def teardown_later(item: _Destroyable) -> None:
    """Destroy a sandbox on a background thread. Its processes are already SIGKILLed (they run
    no more code); what is deferred is reaping, cgroup removal and deleting the work directory."""
    _later(item.destroy)
