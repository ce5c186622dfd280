"""The engine's entry points: execute(request) and execute_batch(requests).

An execution is: pick the language, write the sources into a fresh work directory, compile in one
sandbox (compile limits), then run in another (run limits) once, or once per stdin/stdout case.
Every sandbox runs as a host uid of its own (uids.py) under the status waiter, PID 1, whose keyed
record gives the exact exit status.

Unit tests (python, javascript) never run in the candidate's process. A graded execution is two
sandboxes started together and joined by two pipes: the candidate's bootstrap loads its code and
answers calls; the test driver, in a sandbox of its own under another uid, runs the task's
trusted prelude and tests with the candidate's functions bound to proxies that call across the
pipes by value (harness/wire.py), compares on plain data, and reports the verdict on its own
feedback pipe with a key only it and the supervisor know. The candidate never sees the tests,
the driver's memory or its channel, so it cannot report a pass, and an object with a lying
`__eq__` never reaches the comparison. Both are pre-started interpreters from a warm pool of
pairs.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import hmac
import json
import marshal
import os
import secrets
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import calls as calls_driver
from . import cgroups, languages, records, uids, workdir
from .harness import source as harness_source
from .harness import wire
from .languages import Language, ToolchainMissing
from .pool import WarmPool
from .process import Outcome, SandboxError, SandboxProcess, feedback_cap, teardown_later
from .scoring import compare_output
from .spec import (
    CallResult,
    CaseResult,
    ExecutionRequest,
    ExecutionResult,
    Limits,
    PhaseResult,
    Status,
    StdioCase,
    Trace,
)
from .trace import parse as parse_trace

PYTHON = "/usr/bin/python3"
# Loads the bootstrap precompiled (see _python_boot_code) from an inherited fd: compiling its
# source in every sandbox cost more CPU than the rest of its start-up.
_PY_STUB = ("import marshal,posix,sys;f=int(sys.argv.pop(1));c=posix.read(f,1<<22);posix.close(f);"
            "exec(marshal.loads(c))")
_boot_code: bytes | None = None
_boot_code_lock = threading.Lock()
JS_LOOKUP_FOOTER = ("\n;globalThis.__crucibleLookup__ = (n) => { try { return eval(n); } "
                    "catch (e) { return undefined; } };\n")
"""Appended to a graded JavaScript candidate: top-level declarations of a CommonJS module are
local to it, so the bootstrap reaches them through this accessor (it runs in the candidate's
own process, like everything the candidate controls)."""


def python_boot_source() -> str:
    """The Python bootstrap: the by-value codec, then the bootstrap proper."""
    return harness_source("wire.py") + "\n" + harness_source("python_boot.py")


def _python_boot_code() -> bytes | None:
    """The bootstrap compiled and marshalled by the sandbox's own interpreter (marshal data is
    tied to the interpreter version), once per process; None when that fails (then sandboxes
    compile the source themselves)."""
    global _boot_code
    with _boot_code_lock:
        if _boot_code is None:
            script = ("import marshal,sys;sys.stdout.buffer.write(marshal.dumps(compile("
                      "sys.stdin.read(),'<crucible-boot>','exec')))")
            try:
                done = subprocess.run([PYTHON, "-I", "-S", "-c", script],
                                      input=python_boot_source().encode(),
                                      capture_output=True, timeout=30, check=True)
                _boot_code = done.stdout
            except (OSError, subprocess.SubprocessError):
                _boot_code = b""
        return _boot_code or None


_FDS = ("{CONTROL_FD}", "{FEEDBACK_FD}", "{LINK_IN}", "{LINK_OUT}")


def _python_boot_argv(code: bytes | None) -> list[str]:
    if code is None:
        return [PYTHON, "-I", "-S", "-c", python_boot_source(), *_FDS]
    return [PYTHON, "-I", "-S", "-c", _PY_STUB, "{DATA_FD}", *_FDS]


_BOOT_ARGV = {
    "python": lambda: _python_boot_argv(_python_boot_code()),
    "javascript": lambda: ["/usr/bin/node", "-e", harness_source("node_boot.js"), *_FDS],
}
_SIGNALLED = 128  # bwrap reports a child killed by signal N as exit status 128 + N, and so
# does a program that exits with 128 + N: only the status waiter's record tells them apart.
_BACKSTOP_CPU_MS = 600_000


@dataclass
class EngineConfig:
    """Tuning of one engine; limits of each execution come with its request."""

    warm_languages: tuple[str, ...] = ("python", "javascript")
    pool_size: int = 2
    pool_limits: Limits = field(default_factory=Limits)
    """tmpfs size, file size and open files of warm sandboxes; requests that differ run cold."""


@dataclass
class _Warm:
    """A started bootstrap sandbox, its work directory and its uid."""

    proc: SandboxProcess
    dir: Path
    uid: int
    announces_ready: bool = False  # the bootstrap writes READY on the feedback pipe
    host_links: tuple[int, int] | None = None  # (read from it, write to it): held for a driver

    def wait_booted(self, timeout: float) -> bool:
        """Whether the interpreter finished starting (or, dead, never will) within timeout."""
        return not self.announces_ready or self.proc.wait_feedback(timeout)

    def alive(self) -> bool:
        return self.proc.alive()

    def destroy(self) -> None:
        for fd in self.host_links or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.host_links = None
        self.proc.destroy()
        workdir.remove(self.dir)
        uid = self.uid
        self.proc.when_clean(lambda: uids.release(uid))


@dataclass
class _Zygote:
    """A test driver that forks a fresh copy of itself per execution (python_boot._zygote),
    for the executions of one grader key; its parent end of the request socket."""

    warm: _Warm
    sock: socket.socket
    used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alive(self) -> bool:
        return self.warm.alive()

    def destroy(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self.warm.destroy()


ZYGOTES_MAX = 8
ZYGOTE_IDLE_S = 120.0


@dataclass
class _Pair:
    """A candidate sandbox and its test driver's, joined by two pipes at spawn."""

    candidate: _Warm
    driver: _Warm

    def wait_booted(self, timeout: float) -> bool:
        return self.candidate.wait_booted(timeout) and self.driver.wait_booted(timeout)

    def alive(self) -> bool:
        return self.candidate.alive() and self.driver.alive()

    def destroy(self) -> None:
        try:
            self.candidate.destroy()
        finally:
            self.driver.destroy()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def phase_result(out: Outcome, limits: Limits, *, compile_phase: bool = False) -> PhaseResult:
    """Classify a finished process: limit verdicts first, then the exit status."""
    rc = out.returncode
    signal_no = None
    if out.exit_reported:
        signal_no = out.signal  # seen by the program's parent, the status waiter: exact
    elif rc is not None and rc < 0:
        signal_no = -rc  # bwrap itself was killed (limits, teardown)
    elif rc is not None and _SIGNALLED < rc <= _SIGNALLED + 64:
        signal_no = rc - _SIGNALLED  # ambiguous; only when no status was reported
    if out.output_exceeded:
        status, message = Status.OLE, f"output exceeded {limits.output_bytes} bytes"
    elif out.feedback_error:
        status, message = Status.RE, f"feedback channel refused: {out.feedback_error}"
    elif out.timed_out:
        status, message = Status.TLE, f"wall time exceeded {limits.wall_ms} ms"
    elif out.oom_killed:
        status, message = Status.MLE, f"memory exceeded {limits.memory_mb} MB"
    elif out.cpu_exceeded or signal_no == 24:  # SIGXCPU
        status, message = Status.TLE, f"CPU time exceeded {limits.cpu_ms} ms"
    elif rc == 0:
        status, message = Status.OK, ""
    else:
        status = Status.RE
        message = f"killed by signal {signal_no}" if signal_no else f"exit code {rc}"
        if signal_no == 25:  # SIGXFSZ
            message = f"file size exceeded {limits.file_size_mb} MB"
    if compile_phase and status != Status.OK:
        message = f"compilation failed ({message})"
        status = Status.CE
    return PhaseResult(
        status=status, exit_code=None if signal_no else rc, signal=signal_no,
        stdout=_decode(out.stdout), stderr=_decode(out.stderr),
        stdout_truncated=out.stdout_truncated, stderr_truncated=out.stderr_truncated,
        cpu_ms=out.cpu_ms, wall_ms=out.wall_ms, supervisor_cpu_ms=round(out.supervisor_cpu_ms, 3),
        peak_memory_bytes=out.peak_memory_bytes, message=message,
    )


def _read_back(path: Path, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Files the program left behind, read without following links (see workdir.read)."""
    files: dict[str, str] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            files[name] = _decode(workdir.read(path, name))
        except workdir.UnsafeFile as exc:
            errors[name] = str(exc)
    return files, errors


def _driver_verdict(out: Outcome, key: str) -> tuple[str, str] | None:
    """(kind, detail) from the driver's keyed VERDICT record, or None without one."""
    for kind, value in out.feedback:
        if kind != "VERDICT":
            continue
        got, _, rest = value.partition(" ")
        if hmac.compare_digest(got.encode(), key.encode()):
            verdict, _, detail = rest.partition(" ")
            return verdict, detail.strip()[:500]
    return None


def _await_records(fd: int, deadline: float, zygote: _Zygote) -> tuple[list[tuple[str, str]],
                                                                       float]:
    """A zygote driver's records (PID, then VERDICT) until it closes its pipe; past the
    deadline the driver is killed through its zygote. Returns the records and the CPU this
    thread spent."""
    cpu0 = time.thread_time_ns()
    reader = records.RecordReader(max_records=8)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not reader.stopped:
        left = deadline - time.monotonic()
        if left <= 0:
            pid = next((v for k, v in reader.records if k == "PID"), "")
            if pid.isdigit():
                with contextlib.suppress(OSError), zygote.lock:
                    zygote.sock.send(marshal.dumps({"kill": int(pid)}, 4))
            break
        if not poller.poll(min(left, 1.0) * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        reader.feed(chunk)
    return reader.records, (time.thread_time_ns() - cpu0) / 1e6


_graders: ThreadPoolExecutor | None = None
_graders_lock = threading.Lock()


def _grader_threads() -> ThreadPoolExecutor:
    """Threads that supervise test drivers while the calling thread supervises candidates."""
    global _graders
    with _graders_lock:
        if _graders is None:
            _graders = ThreadPoolExecutor(max_workers=64, thread_name_prefix="sandbox-grader")
        return _graders


class Engine:
    """Runs execution requests in sandboxes; owns the warm pools. Thread-safe."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._pools: dict[tuple[str, str], WarmPool[_Warm | _Pair]] = {}
        self._zygotes: dict[tuple[str, str], _Zygote] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- warm pools ---------------------------------------------------------------------------
    def _pool(self, lang: Language, kind: str = "plain") -> WarmPool | None:
        if lang.name not in self.config.warm_languages or self.config.pool_size <= 0:
            return None
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get((lang.name, kind))
            if pool is None:
                limits = self.config.pool_limits
                spawners: dict[str, Callable[[], _Warm | _Pair]] = {
                    "graded": lambda: self._spawn_pair(lang, limits),
                    "linked": lambda: self._spawn_linked(lang, limits),
                    "plain": lambda: self._spawn_boot(lang, limits)}
                pool = WarmPool(spawners[kind], self.config.pool_size,
                                name=f"warm-{lang.name}-{kind}")
                self._pools[(lang.name, kind)] = pool
            return pool

    def warm_up(self, language: str, timeout: float = 30.0, *, graded: bool = False,
                grader_key: str | None = None) -> bool:
        """Start the language's pool now and wait until it is full: plain sandboxes, or with
        `graded` what graded executions take (candidate and driver pairs; with `grader_key`,
        candidates linked to that key's zygote, which is started too)."""
        lang = languages.get(language)
        kind = "plain" if not graded else "linked" if grader_key else "graded"
        if kind == "linked":
            self._zygote(lang, grader_key or "")
        pool = self._pool(lang, kind)
        return pool.wait_ready(timeout) if pool else False

    def _spawn_boot(
        self, lang: Language, limits: Limits, links: tuple[int, int] | None = None
    ) -> _Warm:
        uid = uids.lease()
        try:
            path = workdir.create({}, owner_uid=uid, owner_gid=uid,
                                  size_bytes=limits.workdir_mb << 20)
        except BaseException:
            uids.release(uid)
            raise
        argv = _BOOT_ARGV[lang.name]()
        data = _python_boot_code() if "{DATA_FD}" in argv else None
        try:
            proc = SandboxProcess(
                argv=argv, workdir=path, limits=limits, uid=uid, env=lang.env,
                ro_binds=lang.binds, with_control=True, cpu_backstop_ms=_BACKSTOP_CPU_MS,
                data=data, links=links, feedback_bytes=feedback_cap(16 << 20),
            )
        except BaseException:
            workdir.remove(path)
            uids.release(uid)
            raise
        return _Warm(proc, path, uid, announces_ready=lang.name == "python")

    def _spawn_pair(self, lang: Language, limits: Limits) -> _Pair:
        to_candidate = os.pipe2(os.O_CLOEXEC)
        to_driver = os.pipe2(os.O_CLOEXEC)
        try:
            candidate = self._spawn_boot(lang, limits, (to_candidate[0], to_driver[1]))
            try:
                driver = self._spawn_boot(lang, limits, (to_driver[0], to_candidate[1]))
            except BaseException:
                candidate.destroy()
                raise
        finally:
            for fd in (*to_candidate, *to_driver):  # each sandbox holds its own ends now
                os.close(fd)
        return _Pair(candidate, driver)

    def _take(self, lang: Language, limits: Limits, kind: str) -> _Warm | _Pair:
        pool_limits = self.config.pool_limits
        fits = (limits.tmpfs_mb, limits.file_size_mb, limits.open_files) == (
            pool_limits.tmpfs_mb, pool_limits.file_size_mb, pool_limits.open_files)
        pool = self._pool(lang, kind) if fits else None
        item = pool.take() if pool else None
        if item is not None and not item.alive():
            teardown_later(item)  # an interpreter died while waiting: never hand it out
            item = None
        if item is not None:
            return item
        if kind == "graded":
            return self._spawn_pair(lang, limits)
        return self._spawn_linked(lang, limits) if kind == "linked" else self._spawn_boot(
            lang, limits)

    def _spawn_linked(self, lang: Language, limits: Limits) -> _Warm:
        """A candidate sandbox whose link pipes' other ends the supervisor holds, to hand to a
        zygote's driver when it is taken."""
        to_candidate = os.pipe2(os.O_CLOEXEC)
        from_candidate = os.pipe2(os.O_CLOEXEC)
        try:
            warm = self._spawn_boot(lang, limits, (to_candidate[0], from_candidate[1]))
        except BaseException:
            for fd in (*to_candidate, *from_candidate):
                os.close(fd)
            raise
        os.close(to_candidate[0])
        os.close(from_candidate[1])
        warm.host_links = (from_candidate[0], to_candidate[1])
        return warm

    def _zygote(self, lang: Language, key: str) -> _Zygote:
        """The live zygote of this grader key, started if needed (at most ZYGOTES_MAX, the
        least recently used and the idle ones go first)."""
        now = time.monotonic()
        stale: list[_Zygote] = []
        with self._lock:
            zygote = self._zygotes.get((lang.name, key))
            if zygote is not None and not zygote.alive():
                stale.append(self._zygotes.pop((lang.name, key)))
                zygote = None
            for k, z in list(self._zygotes.items()):
                if now - z.used > ZYGOTE_IDLE_S:
                    stale.append(self._zygotes.pop(k))
        for old in stale:
            teardown_later(old)
        if zygote is not None:
            zygote.used = now
            return zygote
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Started from a thread that outlives it: bwrap's --die-with-parent is a parent
            # *thread* death signal, and a batch's worker threads end with the batch.
            warm = _grader_threads().submit(
                self._spawn_boot, lang, self.config.pool_limits,
                (child.fileno(), child.fileno())).result()
        finally:
            child.close()
        warm.proc.send_control(self._control(lang, {"mode": "zygote"}))
        zygote = _Zygote(warm, parent)
        with self._lock:
            if self._closed:
                teardown_later(zygote)
                raise SandboxError("the engine is closed")
            other = self._zygotes.setdefault((lang.name, key), zygote)
            evict = (sorted(self._zygotes.items(), key=lambda kv: kv[1].used)
                     [:max(0, len(self._zygotes) - ZYGOTES_MAX)])
            for k, _ in evict:
                stale.append(self._zygotes.pop(k))
        if other is not zygote:
            teardown_later(zygote)
        for old in stale:
            teardown_later(old)
        return other

    # -- execution ----------------------------------------------------------------------------
    def execute(self, request: ExecutionRequest) -> ExecutionResult:
        """Compile and run one request; never raises for the program's misbehaviour."""
        try:
            lang = languages.get(request.language)
        except ToolchainMissing as exc:
            return self._failed(request, str(exc))
        try:
            if request.calls:
                return self._execute_calls(lang, request)
            if lang.name in _BOOT_ARGV:
                if request.tests is not None:
                    if request.grader_key and lang.name == "python":
                        return self._execute_zygote(lang, request)
                    return self._execute_graded(lang, request)
                return self._execute_boot(lang, request)
            return self._execute_plain(lang, request)
        except (SandboxError, cgroups.CgroupError, uids.UidsExhausted, OSError) as exc:
            return self._failed(request, f"sandbox failure: {exc}")

    @staticmethod
    def _failed(request: ExecutionRequest, message: str) -> ExecutionResult:
        graded = request.tests is not None or bool(request.cases)
        return ExecutionResult(status=Status.SANDBOX_ERROR, language=request.language,
                               message=message, verdict="sandbox_error" if graded else None)

    def _execute_safely(self, request: ExecutionRequest) -> ExecutionResult:
        """execute(), and an engine bug in one request is that request's SANDBOX_ERROR, never
        the loss of the other results of its batch."""
        try:
            return self.execute(request)
        except Exception as exc:  # noqa: BLE001 - one request's failure must stay its own
            return self._failed(request, f"sandbox failure: {type(exc).__name__}: {exc}")

    def execute_batch(
        self, requests: Iterable[ExecutionRequest], concurrency: int = 2
    ) -> list[ExecutionResult]:
        """Execute many requests, at most `concurrency` at once, results in request order."""
        items = list(requests)
        if concurrency <= 1 or len(items) <= 1:
            return [self._execute_safely(r) for r in items]
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox") as ex:
            return list(ex.map(self._execute_safely, items))

    def _run_boot_once(
        self, lang: Language, request: ExecutionRequest, files: dict[str, str], stdin: str,
    ) -> Outcome:
        warm = self._take(lang, request.limits, "plain")
        assert isinstance(warm, _Warm)
        try:
            self._prepare(warm, request, files)
            control = {
                "mode": "run", "argv": request.argv,
                "trace": request.trace.model_dump() if request.trace and lang.name == "python"
                else None,
            }
            out = warm.proc.run(stdin.encode(), control=self._control(lang, control))
            out.extra["files"] = _read_back(warm.dir, request.read_back)
            return out
        finally:
            teardown_later(warm)

    @staticmethod
    def _prepare(warm: _Warm, request: ExecutionRequest, files: dict[str, str]) -> None:
        workdir.resize(warm.dir, workdir.files_bytes(files) + (request.limits.workdir_mb << 20),
                       owner_uid=warm.uid, owner_gid=warm.uid)
        workdir.write(warm.dir, files, owner_uid=warm.uid, owner_gid=warm.uid)
        warm.proc.relimit(request.limits)

    @staticmethod
    def _control(lang: Language, control: dict[str, Any]) -> bytes:
        # Python's bootstrap reads marshal (a built-in module: no import cost), Node's JSON.
        if lang.name == "python":
            return marshal.dumps(control, 4)
        return json.dumps(control).encode()

    def _execute_boot(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        files = {**request.files, lang.source: request.code}
        if request.cases:
            results = [self._case(self._run_boot_once(lang, request, files, case.stdin),
                                  request.limits, case) for case in request.cases]
            return self._from_cases(lang, results)
        out = self._run_boot_once(lang, request, files, request.stdin)
        result = ExecutionResult(language=lang.name,
                                 **phase_result(out, request.limits).model_dump())
        result.files, result.file_errors = out.extra["files"]  # type: ignore[misc]
        if request.trace:
            payload = next((v for k, v in out.feedback if k == "TRACE"), None)
            if payload is not None:
                result.trace = _trace(payload, request)
        return result

    def _execute_graded(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        code = request.code + (JS_LOOKUP_FOOTER if lang.name == "javascript" else "")
        files = {**request.files, lang.source: code}
        pair = self._take(lang, request.limits, "graded")
        assert isinstance(pair, _Pair)
        key = secrets.token_hex(16)
        try:
            self._prepare(pair.candidate, request, files)
            pair.driver.proc.relimit(request.limits)
            serve = {"mode": "serve", "argv": request.argv,
                     "trace": request.trace.model_dump() if request.trace and lang.name ==
                     "python" else None}
            drive = {"mode": "drive", "key": key, "prelude": request.test_prelude,
                     "tests": request.tests, "bind": request.entry_points}
            driven = _grader_threads().submit(pair.driver.proc.run, b"",
                                              control=self._control(lang, drive))
            try:
                out = pair.candidate.proc.run(request.stdin.encode(),
                                              control=self._control(lang, serve))
            finally:
                graded = driven.result()
            out.extra["files"] = _read_back(pair.candidate.dir, request.read_back)
        finally:
            teardown_later(pair)
        return self._graded_result(lang, request, out, graded, key)

    def _execute_zygote(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        """As _execute_graded, with the driver forked by the grader key's zygote instead of a
        sandbox started for this execution alone."""
        assert request.grader_key is not None
        candidate = self._take(lang, request.limits, "linked")
        assert isinstance(candidate, _Warm) and candidate.host_links is not None
        key = secrets.token_hex(16)
        verdict_r, verdict_w = os.pipe2(os.O_CLOEXEC)
        started = time.monotonic()
        deadline = started + request.limits.wall_ms / 1000 + 1.0
        try:
            self._prepare(candidate, request, {**request.files, lang.source: request.code})
            drive = marshal.dumps({"key": key, "prelude": request.test_prelude,
                                   "tests": request.tests, "bind": request.entry_points}, 4)
            fds = [*candidate.host_links, verdict_w]
            for attempt in (1, 2):
                zygote = self._zygote(lang, request.grader_key)
                try:
                    with zygote.lock:
                        zygote.sock.sendmsg([drive], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                       array.array("i", fds))])
                    break
                except OSError:  # the zygote died: start another, once
                    with self._lock:
                        if self._zygotes.get((lang.name, request.grader_key)) is zygote:
                            del self._zygotes[(lang.name, request.grader_key)]
                    teardown_later(zygote)
                    if attempt == 2:
                        raise
            for fd in fds:  # the driver holds them now
                os.close(fd)
            candidate.host_links = None
            verdict_w = -1
            waited = _grader_threads().submit(_await_records, verdict_r, deadline, zygote)
            try:
                out = candidate.proc.run(request.stdin.encode(),
                                         control=self._control(lang, {"mode": "serve",
                                                                      "argv": request.argv}))
            finally:
                records, driver_cpu = waited.result()
            out.extra["files"] = _read_back(candidate.dir, request.read_back)
        finally:
            for fd in (verdict_r, verdict_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            teardown_later(candidate)
        graded = Outcome(feedback=records, returncode=0,
                         wall_ms=int((time.monotonic() - started) * 1000))
        graded.supervisor_cpu_ms = driver_cpu
        return self._graded_result(lang, request, out, graded, key)

    @staticmethod
    def _graded_result(
        lang: Language, request: ExecutionRequest, out: Outcome, graded: Outcome, key: str
    ) -> ExecutionResult:
        phase = phase_result(out, request.limits)
        grader = phase_result(graded, request.limits).model_copy(
            update={"stdout": "", "stderr": "", "stdout_truncated": False,
                    "stderr_truncated": False})
        result = ExecutionResult(language=lang.name, grader=grader, **phase.model_dump())
        result.supervisor_cpu_ms = round(out.supervisor_cpu_ms + graded.supervisor_cpu_ms, 3)
        result.files, result.file_errors = out.extra["files"]  # type: ignore[misc]
        reported = _driver_verdict(graded, key)
        if phase.status == Status.TLE:
            verdict, detail = "timeout", phase.message
        elif reported is None:
            verdict, detail = "driver_error", f"the test driver gave no verdict ({grader.status}" \
                f"{': ' + grader.message if grader.message else ''})"
        else:
            verdict, detail = reported
            if verdict == "exited":
                verdict = "exited_early"
            if verdict == "passed" and phase.status != Status.OK:
                verdict, detail = "failed", f"the candidate ended badly: {phase.message}"
        if verdict not in ("passed", "failed", "exited_early", "timeout", "driver_error"):
            verdict, detail = "driver_error", f"unknown verdict {verdict[:40]!r}"
        result.verdict, result.verdict_detail = verdict, detail
        result.tests_passed = verdict == "passed"
        if not result.tests_passed and result.status == Status.OK:
            result.status = Status.RE
            result.message = f"tests did not pass: {detail}"
        if request.trace:
            payload = next((v for k, v in out.feedback if k == "TRACE"), None)
            if payload is not None:
                result.trace = _trace(payload, request)
        return result

    def _execute_calls(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        """Call cases: the candidate's call server answers, the supervisor compares (calls.py).
        Every call fails unless the program also ends cleanly once the calls are done."""
        to_candidate = os.pipe2(os.O_CLOEXEC)
        from_candidate = os.pipe2(os.O_CLOEXEC)
        links = (to_candidate[0], from_candidate[1])
        unsent: tuple[int, ...] = links  # the sandbox's ends still ours to close
        host_fds = [to_candidate[1], from_candidate[0]]
        warm: _Warm | None = None
        proc: SandboxProcess | None = None
        path: Path | None = None
        uid: int | None = None
        try:
            if lang.name in _BOOT_ARGV:
                code = request.code + (JS_LOOKUP_FOOTER if lang.name == "javascript" else "")
                warm = self._spawn_boot(lang, request.limits, links)
                self._prepare(warm, request, {**request.files, lang.source: code})
                proc, control = warm.proc, self._control(lang, {"mode": "serve",
                                                                "argv": request.argv})
            else:
                if lang.serve is None:
                    raise SandboxError(f"{lang.name} has no call server")
                uid = uids.lease()
                for fd in links:  # servers that reopen /dev/fd/N (Lua) need to own the pipes
                    os.fchown(fd, uid, uid)
                path = workdir.create({**request.files, lang.source: request.code},
                                      owner_uid=uid, owner_gid=uid,
                                      size_bytes=request.limits.workdir_mb << 20)
                limits = request.limits
                if lang.name == "php":  # php://fd/N refuses N >= RLIMIT_NOFILE (see the server)
                    limits = limits.model_copy(
                        update={"open_files": max(limits.open_files, max(links) + 16)})
                proc = SandboxProcess(argv=list(lang.serve), workdir=path, limits=limits,
                                      uid=uid, env=lang.env, ro_binds=lang.binds, links=links)
                control = None
            for fd in links:  # the sandbox holds its ends now
                os.close(fd)
            unsent = ()
            deadline = time.monotonic() + request.limits.wall_ms / 1000
            cpu0 = time.thread_time_ns()

            def driven() -> tuple[list[CallResult], str, float]:
                results, stopped = calls_driver.drive(host_fds[1], host_fds[0], request.calls,
                                                      deadline)
                host_fds.remove(host_fds[0])  # drive() closed the write end
                return results, stopped, (time.thread_time_ns() - cpu0) / 1e6

            future = _grader_threads().submit(driven)
            try:
                out = proc.run(request.stdin.encode(), control=control)
            finally:
                results, stopped, driver_cpu = future.result()
            read_back = _read_back(warm.dir if warm else path, request.read_back)  # type: ignore[arg-type]
        finally:
            for fd in (*unsent, *host_fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
            if warm is not None:
                teardown_later(warm)
            elif proc is not None:
                proc.destroy()
            if path is not None:
                workdir.remove(path)
            if uid is not None and proc is not None:
                leased = uid
                proc.when_clean(lambda: uids.release(leased))
        phase = phase_result(out, request.limits)
        result = ExecutionResult(language=lang.name, calls=results, **phase.model_dump())
        result.supervisor_cpu_ms = round(out.supervisor_cpu_ms + driver_cpu, 3)
        result.files, result.file_errors = read_back
        if phase.status != Status.OK:
            for call in result.calls:
                if call.passed:
                    call.passed, call.error = False, f"the program ended badly: {phase.message}"
        failed = next((c for c in result.calls if not c.passed), None)
        if failed is None:
            result.verdict = "passed"
        elif phase.status == Status.TLE:
            result.verdict, result.verdict_detail = "timeout", phase.message
        elif stopped and "exited" in stopped:
            result.verdict, result.verdict_detail = "exited_early", stopped
        else:
            result.verdict = "failed"
            result.verdict_detail = f"{failed.function}: {failed.error}" + (
                f" (returned {failed.got})" if failed.got else "")
        if result.verdict != "passed" and result.status == Status.OK:
            result.status, result.message = Status.RE, f"calls did not pass: " \
                f"{result.verdict_detail}"
        return result

    def _execute_plain(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        room = (request.compile_limits if lang.compile else request.limits).workdir_mb << 20
        uid = uids.lease()
        phases: list[SandboxProcess] = []
        try:
            path = workdir.create({**request.files, lang.source: request.code},
                                  owner_uid=uid, owner_gid=uid, size_bytes=room)
        except BaseException:
            uids.release(uid)
            raise
        try:
            compiled: PhaseResult | None = None
            if lang.compile:
                compiled, _ = self._phase(lang, path, list(lang.compile),
                                          request.compile_limits, "", uid, phases,
                                          compile_phase=True)
                if compiled.status != Status.OK:
                    return ExecutionResult(
                        status=compiled.status, language=lang.name, compile=compiled,
                        stdout=compiled.stdout, stderr=compiled.stderr,
                        message=(compiled.message + "\n" + compiled.stderr + compiled.stdout)
                        .strip()[:64_000],
                        verdict="compile_error" if request.cases else None,
                    )
                # the program gets its own room on top of what the compiler left
                workdir.resize(path, request.limits.workdir_mb << 20,
                               owner_uid=uid, owner_gid=uid)
            run_argv = [*lang.run, *request.argv]
            if request.cases:
                results = []
                for c in request.cases:
                    _, out = self._phase(lang, path, run_argv, request.limits, c.stdin, uid,
                                         phases)
                    results.append(self._case(out, request.limits, c))
                result = self._from_cases(lang, results)
            else:
                phase, _ = self._phase(lang, path, run_argv, request.limits, request.stdin,
                                       uid, phases)
                result = ExecutionResult(language=lang.name, **phase.model_dump())
                result.files, result.file_errors = _read_back(path, request.read_back)
            result.compile = compiled
            return result
        finally:
            workdir.remove(path)
            _release_when_clean(uid, phases)

    def _phase(
        self, lang: Language, path: Path, argv: list[str], limits: Limits, stdin: str,
        uid: int, phases: list[SandboxProcess], *, compile_phase: bool = False,
    ) -> tuple[PhaseResult, Outcome]:
        """(result, raw outcome); the destroyed sandbox joins `phases`."""
        # A compiler's status only decides OK or CE (bwrap's own status says that exactly): it
        # runs without the waiter.
        proc = SandboxProcess(argv=argv, workdir=path, limits=limits, uid=uid, env=lang.env,
                              ro_binds=lang.binds, waiter=not compile_phase)
        phases.append(proc)
        try:
            out = proc.run(stdin.encode())
        finally:
            proc.destroy()
        return phase_result(out, limits, compile_phase=compile_phase), out

    @staticmethod
    def _case(out: Outcome, limits: Limits, case: StdioCase) -> CaseResult:
        """The supervisor's own comparison of the bytes it captured with the expected output."""
        phase = phase_result(out, limits)
        passed = phase.status == Status.OK and compare_output(
            phase.stdout, case.expected_stdout, tolerant=case.comparison == "tolerant",
            abs_tol=case.abs_tol, rel_tol=case.rel_tol,
        )
        return CaseResult(passed=passed, **phase.model_dump())

    @staticmethod
    def _from_cases(lang: Language, cases: Sequence[CaseResult]) -> ExecutionResult:
        """Headline fields come from the first case that did not pass (or the last one)."""
        head = next((c for c in cases if not c.passed), cases[-1])
        fields = head.model_dump(exclude={"passed"})
        fields["cpu_ms"] = sum(c.cpu_ms for c in cases)
        fields["wall_ms"] = sum(c.wall_ms for c in cases)
        fields["supervisor_cpu_ms"] = round(sum(c.supervisor_cpu_ms for c in cases), 3)
        fields["peak_memory_bytes"] = max(c.peak_memory_bytes for c in cases)
        if head.passed:
            verdict, detail = "passed", ""
        elif head.status == Status.SANDBOX_ERROR:
            verdict, detail = "sandbox_error", head.message
        elif head.status == Status.TLE:
            verdict, detail = "timeout", head.message
        else:
            index = list(cases).index(head)
            detail = (f"case {index}: wrong output" if head.status == Status.OK
                      else f"case {index}: {head.status} {head.message}".strip())
            verdict = "failed"
        return ExecutionResult(language=lang.name, cases=list(cases), verdict=verdict,
                               verdict_detail=detail, **fields)

    def close(self) -> None:
        """Destroy the warm sandboxes; the engine then runs everything cold."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
            zygotes = list(self._zygotes.values())
            self._zygotes.clear()
        for pool in pools:
            pool.close()
        for zygote in zygotes:
            zygote.destroy()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_when_clean(uid: int, procs: list[SandboxProcess]) -> None:
    """Give `uid` back once every sandbox that ran as it has no process left."""
    pending = [len(procs)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            pending[0] -= 1
            last = pending[0] == 0
        if last:
            uids.release(uid)

    if not procs:
        uids.release(uid)
    for proc in procs:
        proc.when_clean(one_done)


def _trace(payload: str, request: ExecutionRequest) -> Trace | None:
    """The program's trace record (its own process wrote it: parsed defensively)."""
    assert request.trace is not None
    with contextlib.suppress(wire.WireError, UnicodeError, ValueError):
        return parse_trace(wire.loads(payload.encode("ascii", errors="replace")), request.trace)
    return None


_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """A process-wide engine (created on first use) for the module-level helpers."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Engine()
            atexit.register(_default.close)  # warm sandboxes, their cgroups and directories
        return _default


def execute(request: ExecutionRequest) -> ExecutionResult:
    """Execute one request with the process-wide engine."""
    return default_engine().execute(request)


def execute_batch(
    requests: Iterable[ExecutionRequest], concurrency: int = 2
) -> list[ExecutionResult]:
    """Execute many requests with the process-wide engine, `concurrency` at a time."""
    return default_engine().execute_batch(requests, concurrency=concurrency)


__all__ = ["Engine", "EngineConfig", "execute", "execute_batch", "default_engine"]
