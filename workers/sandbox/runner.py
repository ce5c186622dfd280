"""The engine's entry points: execute(request) and execute_batch(requests).

An execution is: pick the language, write the sources into a fresh work directory, compile in one
sandbox (compile limits), then run in another (run limits) once, or once per stdin/stdout case.
Python and JavaScript run through a bootstrap that waits on a control pipe, which is what lets the
warm pool start their interpreters ahead of time; the same bootstrap carries the test verdict and
the trace back on a separate feedback pipe, each line tagged with a per-execution nonce.
"""

from __future__ import annotations

import atexit
import json
import marshal
import os
import secrets
import subprocess
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import cgroups, languages, workdir
from .harness import source as harness_source
from .languages import Language, ToolchainMissing
from .pool import WarmPool
from .process import (
    SANDBOX_GID,
    SANDBOX_UID,
    Outcome,
    SandboxError,
    SandboxProcess,
    teardown_later,
)
from .scoring import compare_output
from .spec import (
    CaseResult,
    ExecutionRequest,
    ExecutionResult,
    Limits,
    PhaseResult,
    Status,
    StdioCase,
)
from .trace import parse as parse_trace

PYTHON = "/usr/bin/python3"
# Loads the bootstrap precompiled (see _python_boot_code) from an inherited fd: compiling its
# source in every sandbox cost more CPU than the rest of its start-up.
_PY_STUB = ("import marshal,posix,sys;f=int(sys.argv.pop(1));c=posix.read(f,1<<22);posix.close(f);"
            "exec(marshal.loads(c))")
_boot_code: bytes | None = None
_boot_code_lock = threading.Lock()


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
                                      input=harness_source("python_boot.py").encode(),
                                      capture_output=True, timeout=30, check=True)
                _boot_code = done.stdout
            except (OSError, subprocess.SubprocessError):
                _boot_code = b""
        return _boot_code or None


def _python_boot_argv(code: bytes | None) -> list[str]:
    if code is None:
        return [PYTHON, "-I", "-S", "-c", harness_source("python_boot.py"),
                "{CONTROL_FD}", "{FEEDBACK_FD}"]
    return [PYTHON, "-I", "-S", "-c", _PY_STUB, "{DATA_FD}", "{CONTROL_FD}", "{FEEDBACK_FD}"]


_BOOT_ARGV = {
    "python": lambda: _python_boot_argv(_python_boot_code()),
    "javascript": lambda: ["/usr/bin/node", "-e", harness_source("node_boot.js"),
                           "{CONTROL_FD}", "{FEEDBACK_FD}"],
}
_SIGNALLED = 128  # bwrap reports a child killed by signal N as exit status 128 + N, and so
# does a program that exits with 128 + N: only a status reported from inside the sandbox (the
# bootstrap's waiting half, or the status waiter) tells them apart.
_BACKSTOP_CPU_MS = 600_000
PERL = "/usr/bin/perl"


def _waiter_argv(argv: list[str], tag: str) -> list[str]:
    """argv under the status waiter (PID 1, reports the program's real wait status), or argv
    unchanged where Perl is missing (then exit codes 129-192 read as signals)."""
    if not os.access(PERL, os.X_OK):
        return argv
    return [PERL, "-e", harness_source("status_waiter.pl"), "{FEEDBACK_FD}", tag, *argv]


@dataclass
class EngineConfig:
    """Tuning of one engine; limits of each execution come with its request."""

    warm_languages: tuple[str, ...] = ("python", "javascript")
    pool_size: int = 2
    pool_limits: Limits = field(default_factory=Limits)
    """tmpfs size, file size and open files of warm sandboxes; requests that differ run cold."""


@dataclass
class _Warm:
    """A started bootstrap sandbox and its work directory."""

    proc: SandboxProcess
    dir: Path
    announces_ready: bool = False  # the bootstrap writes READY on the feedback pipe

    def wait_booted(self, timeout: float) -> bool:
        """Whether the interpreter finished starting (or, dead, never will) within timeout."""
        return not self.announces_ready or self.proc.wait_feedback(timeout)

    def destroy(self) -> None:
        self.proc.destroy()
        workdir.remove(self.dir)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def phase_result(out: Outcome, limits: Limits, *, compile_phase: bool = False) -> PhaseResult:
    """Classify a finished process: limit verdicts first, then the exit status."""
    rc = out.returncode
    signal_no = None
    if out.exit_reported:
        signal_no = out.signal  # seen by the program's parent: exact
    elif rc is not None and rc < 0:
        signal_no = -rc  # bwrap itself was killed (limits, teardown)
    elif rc is not None and _SIGNALLED < rc <= _SIGNALLED + 64:
        signal_no = rc - _SIGNALLED  # ambiguous; only when no status was reported
    if out.output_exceeded:
        status, message = Status.OLE, f"output exceeded {limits.output_bytes} bytes"
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
        cpu_ms=out.cpu_ms, wall_ms=out.wall_ms, peak_memory_bytes=out.peak_memory_bytes,
        message=message,
    )


def _feedback(out: Outcome, nonce: str) -> dict[str, str]:
    """The lines tagged with this execution's nonce; anything else on the channel is ignored."""
    found: dict[str, str] = {}
    prefix = nonce + " "
    for line in _decode(out.feedback).splitlines():
        if line.startswith(prefix):
            kind, _, payload = line[len(prefix):].partition(" ")
            found.setdefault(kind, payload)
    return found


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


class Engine:
    """Runs execution requests in sandboxes; owns the warm pools. Thread-safe."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._pools: dict[str, WarmPool[_Warm]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- warm pools ---------------------------------------------------------------------------
    def _pool(self, lang: Language) -> WarmPool[_Warm] | None:
        if lang.name not in self.config.warm_languages or self.config.pool_size <= 0:
            return None
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(lang.name)
            if pool is None:
                pool = WarmPool(lambda: self._spawn_boot(lang, self.config.pool_limits),
                                self.config.pool_size, name=f"warm-{lang.name}")
                self._pools[lang.name] = pool
            return pool

    def warm_up(self, language: str, timeout: float = 30.0) -> bool:
        """Start the language's pool now and wait until it is full."""
        pool = self._pool(languages.get(language))
        return pool.wait_ready(timeout) if pool else False

    def _spawn_boot(self, lang: Language, limits: Limits) -> _Warm:
        path = workdir.create({}, owner_uid=SANDBOX_UID, owner_gid=SANDBOX_GID,
                              size_bytes=limits.workdir_mb << 20)
        argv = _BOOT_ARGV[lang.name]()
        data = _python_boot_code() if "{DATA_FD}" in argv else None
        try:
            proc = SandboxProcess(
                argv=argv, workdir=path, limits=limits, env=lang.env,
                ro_binds=lang.binds, with_control=True, cpu_backstop_ms=_BACKSTOP_CPU_MS,
                data=data,
            )
        except BaseException:
            workdir.remove(path)
            raise
        return _Warm(proc, path, announces_ready=lang.name == "python")

    def _boot_sandbox(self, lang: Language, limits: Limits) -> _Warm:
        pool_limits = self.config.pool_limits
        fits = (limits.tmpfs_mb, limits.file_size_mb, limits.open_files) == (
            pool_limits.tmpfs_mb, pool_limits.file_size_mb, pool_limits.open_files)
        pool = self._pool(lang) if fits else None
        warm = pool.take() if pool else None
        if warm is not None and not warm.proc.alive():
            teardown_later(warm)  # its interpreter died while waiting: never hand it out
            warm = None
        return warm or self._spawn_boot(lang, limits)

    # -- execution ----------------------------------------------------------------------------
    def execute(self, request: ExecutionRequest) -> ExecutionResult:
        """Compile and run one request; never raises for the program's misbehaviour."""
        try:
            lang = languages.get(request.language)
        except ToolchainMissing as exc:
            return ExecutionResult(status=Status.SANDBOX_ERROR, language=request.language,
                                   message=str(exc))
        try:
            if lang.name in _BOOT_ARGV:
                return self._execute_boot(lang, request)
            return self._execute_plain(lang, request)
        except (SandboxError, cgroups.CgroupError, OSError) as exc:
            return ExecutionResult(status=Status.SANDBOX_ERROR, language=lang.name,
                                   message=f"sandbox failure: {exc}")

    def execute_batch(
        self, requests: Iterable[ExecutionRequest], concurrency: int = 2
    ) -> list[ExecutionResult]:
        """Execute many requests, at most `concurrency` at once, results in request order."""
        items = list(requests)
        if concurrency <= 1 or len(items) <= 1:
            return [self.execute(r) for r in items]
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox") as ex:
            return list(ex.map(self.execute, items))

    def _run_boot_once(
        self, lang: Language, request: ExecutionRequest, files: dict[str, str], stdin: str,
        nonce: str,
    ) -> tuple[Outcome, dict[str, str]]:
        warm = self._boot_sandbox(lang, request.limits)
        try:
            workdir.resize(warm.dir, workdir.files_bytes(files) + (request.limits.workdir_mb << 20),
                           owner_uid=SANDBOX_UID, owner_gid=SANDBOX_GID)
            workdir.write(warm.dir, files, owner_uid=SANDBOX_UID, owner_gid=SANDBOX_GID)
            warm.proc.relimit(request.limits)
            control = {
                "nonce": nonce, "argv": request.argv, "tests": request.tests,
                "trace": request.trace.model_dump() if request.trace and lang.name == "python"
                else None,
            }
            # Python's bootstrap reads marshal (a built-in module: no import cost), Node's JSON.
            payload = marshal.dumps(control, 4) if lang.name == "python" else json.dumps(control)
            # Python's bootstrap reports after the program is gone; Node's from an 'exit'
            # listener, after which other listeners may still print: wait for it to end.
            out = warm.proc.run(stdin.encode(), control=payload if isinstance(payload, bytes)
                                else payload.encode(), status_prefix=f"{nonce} ".encode(),
                                end_on_status=lang.name == "python")
            out.extra["files"] = _read_back(warm.dir, request.read_back)
            return out, _feedback(out, nonce)
        finally:
            teardown_later(warm)

    def _execute_boot(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        code = request.code
        tests = request.tests
        if lang.name == "javascript" and tests is not None:
            code = f"{code}\n;\n{tests}\n"  # CommonJS: tests must share the module scope
        files = {**request.files, lang.source: code}
        if request.cases:
            results = [
                self._case(self._run_boot_once(lang, request, files, case.stdin,
                                               secrets.token_hex(16))[0], request.limits, case)
                for case in request.cases
            ]
            return self._from_cases(lang, results)
        nonce = secrets.token_hex(16)
        out, feedback = self._run_boot_once(lang, request, files, request.stdin, nonce)
        result = ExecutionResult(language=lang.name,
                                 **phase_result(out, request.limits).model_dump())
        result.files, result.file_errors = out.extra["files"]  # type: ignore[misc]
        if tests is not None:
            result.tests_passed = "PASS" in feedback and result.status == Status.OK
            if not result.tests_passed and result.status == Status.OK:
                result.status = Status.RE
                result.message = "tests did not report a verdict (exited before they finished)"
        if request.trace and "TRACE" in feedback:
            result.trace = parse_trace(feedback["TRACE"], request.trace)
        return result

    def _execute_plain(self, lang: Language, request: ExecutionRequest) -> ExecutionResult:
        room = (request.compile_limits if lang.compile else request.limits).workdir_mb << 20
        path = workdir.create({**request.files, lang.source: request.code},
                              owner_uid=SANDBOX_UID, owner_gid=SANDBOX_GID, size_bytes=room)
        try:
            compiled: PhaseResult | None = None
            if lang.compile:
                compiled = self._phase(lang, path, list(lang.compile), request.compile_limits, "",
                                       compile_phase=True)[0]
                if compiled.status != Status.OK:
                    return ExecutionResult(
                        status=compiled.status, language=lang.name, compile=compiled,
                        stdout=compiled.stdout, stderr=compiled.stderr,
                        message=(compiled.message + "\n" + compiled.stderr + compiled.stdout)
                        .strip()[:64_000],
                    )
                # the program gets its own room on top of what the compiler left
                workdir.resize(path, request.limits.workdir_mb << 20,
                               owner_uid=SANDBOX_UID, owner_gid=SANDBOX_GID)
            run_argv = [*lang.run, *request.argv]
            if request.cases:
                results = [
                    self._case(self._phase(lang, path, run_argv, request.limits, c.stdin)[1],
                               request.limits, c)
                    for c in request.cases
                ]
                result = self._from_cases(lang, results)
            else:
                phase, _ = self._phase(lang, path, run_argv, request.limits, request.stdin)
                result = ExecutionResult(language=lang.name, **phase.model_dump())
                result.files, result.file_errors = _read_back(path, request.read_back)
            result.compile = compiled
            return result
        finally:
            workdir.remove(path)

    def _phase(
        self, lang: Language, path: Path, argv: list[str], limits: Limits, stdin: str,
        *, compile_phase: bool = False,
    ) -> tuple[PhaseResult, Outcome]:
        tag = secrets.token_hex(8)
        # A compiler's status only decides OK or CE: it runs without the waiter.
        wrapped = argv if compile_phase else _waiter_argv(argv, tag)
        proc = SandboxProcess(argv=wrapped, workdir=path, limits=limits, env=lang.env,
                              ro_binds=lang.binds, as_pid_1=wrapped is not argv)
        try:
            # Waits for the sandbox to end rather than for the first status line, which the
            # program could forge to end a run early (e.g. print the answer, then hang).
            out = proc.run(stdin.encode(), status_prefix=f"{tag} ".encode(), end_on_status=False)
        finally:
            proc.destroy()
        return phase_result(out, limits, compile_phase=compile_phase), out

    @staticmethod
    def _case(out: Outcome, limits: Limits, case: StdioCase) -> CaseResult:
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
        fields["peak_memory_bytes"] = max(c.peak_memory_bytes for c in cases)
        return ExecutionResult(language=lang.name, cases=list(cases), **fields)

    def close(self) -> None:
        """Destroy the warm sandboxes; the engine then runs everything cold."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
