"""Request and result models of the sandbox engine.

Pure pydantic with no heavy imports, so the control plane can validate an execution request (or a
run config that embeds one) without importing the engine itself.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

LANGUAGES: tuple[str, ...] = (
    "python",
    "c",
    "cpp",
    "javascript",
    "typescript",
    "bash",
    "rust",
    "java",
    "go",
    "ruby",
    "php",
    "lua",
)
"""Every language the engine knows; which are usable depends on the toolchains installed."""

TEST_LANGUAGES: tuple[str, ...] = ("python", "javascript")
"""Languages whose unit tests (code) run in a test driver of the same language, in a sandbox of
its own, calling the candidate's functions across a pipe by value."""

CALL_LANGUAGES: tuple[str, ...] = ("python", "javascript", "ruby", "php", "lua")
"""Languages with a call server: their top-level functions can be graded with `calls` (function,
arguments, expected result), which the supervisor sends across a pipe by value and compares on
plain data itself, so no test code runs at all."""

VERDICTS: tuple[str, ...] = (
    "passed", "failed", "exited_early", "timeout", "driver_error", "compile_error",
    "sandbox_error",
)
"""How a graded execution's verdict was reached: the tests ran and passed; they ran and failed
(an assertion, a wrong output, an exception); the candidate exited or crashed before the tests
were done with it; it ran out of time; the grader itself failed (the task's test code, not the
candidate); the program did not compile; the engine failed."""


class Status(StrEnum):
    """Outcome of one phase (compile or run) or of a whole execution."""

    OK = "OK"
    TLE = "TLE"  # wall-clock or CPU time limit exceeded
    MLE = "MLE"  # memory limit exceeded (the cgroup OOM-killed the program)
    OLE = "OLE"  # output limit exceeded
    RE = "RE"  # runtime error: non-zero exit, signal, or failed tests
    CE = "CE"  # compile error
    SANDBOX_ERROR = "SANDBOX_ERROR"  # the engine, not the program, failed


class Limits(BaseModel):
    """Resource limits of one phase; every field has a safe default."""

    model_config = ConfigDict(extra="forbid")

    wall_ms: int = Field(10_000, ge=10, le=600_000)
    cpu_ms: int = Field(5_000, ge=10, le=600_000)
    memory_mb: int = Field(256, ge=16, le=65_536, description="RAM, no swap, whole process tree")
    pids: int = Field(64, ge=4, le=4096, description="processes and threads at once")
    file_size_mb: int = Field(16, ge=0, le=4096, description="largest file the program may write")
    open_files: int = Field(64, ge=16, le=65_536)
    output_bytes: int = Field(1 << 20, ge=0, le=64 << 20, description="stdout + stderr")
    tmpfs_mb: int = Field(64, ge=1, le=4096, description="size of the private /tmp")
    workdir_mb: int = Field(
        64, ge=1, le=4096,
        description="room the program has in /work, on top of the request's files (and of the "
        "compiler's outputs): /work is a tmpfs of its own, so many files cannot fill the host",
    )


def default_compile_limits() -> Limits:
    """Compilers (rustc, javac, go) need far more time, memory and threads than programs."""
    return Limits(
        wall_ms=60_000, cpu_ms=60_000, memory_mb=2048, pids=256, file_size_mb=256,
        open_files=1024, output_bytes=256 << 10, tmpfs_mb=512, workdir_mb=512,
    )


class TraceOptions(BaseModel):
    """Opt-in execution trace (Python only); caps keep tracing from dominating the run."""

    model_config = ConfigDict(extra="forbid")

    max_events: int = Field(2_000, ge=1, le=200_000)
    max_bytes: int = Field(256 << 10, ge=1024, le=16 << 20)
    snapshot_locals: bool = True
    max_repr: int = Field(80, ge=8, le=4096, description="characters kept of each local's repr")


class StdioCase(BaseModel):
    """One stdin/stdout test case; the program's output is compared on the host."""

    model_config = ConfigDict(extra="forbid")

    stdin: str = ""
    expected_stdout: str
    comparison: Literal["exact", "tolerant"] = "exact"
    abs_tol: float = Field(1e-6, ge=0)
    rel_tol: float = Field(1e-6, ge=0)


class CallCase(BaseModel):
    """One call of a candidate's function: the supervisor sends `args` by value and compares the
    plain-data result with `expected` (numbers by value, bools only with bools, sequences and
    mappings element by element; `tolerant` compares floats within the tolerances)."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(max_length=200)
    args: list[Any] = Field(default_factory=list, max_length=64)
    expected: Any = None
    comparison: Literal["exact", "tolerant"] = "exact"
    abs_tol: float = Field(1e-6, ge=0)
    rel_tol: float = Field(1e-6, ge=0)

    @field_validator("function")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier() or value.startswith("__"):
            raise ValueError(f"function {value!r} must be a plain identifier")
        return value


class CallResult(BaseModel):
    """A call's outcome: what came back (its repr, capped) and whether it matched."""

    function: str
    passed: bool = False
    got: str = ""
    error: str = ""


class ExecutionRequest(BaseModel):
    """One program to compile (if needed) and run, optionally against tests."""

    model_config = ConfigDict(extra="forbid")

    language: str
    code: str = Field(max_length=4 << 20)
    stdin: str = Field("", max_length=16 << 20)
    argv: list[str] = Field(default_factory=list, max_length=64)
    files: dict[str, str] = Field(
        default_factory=dict, description="extra files written into the work directory"
    )
    limits: Limits = Field(default_factory=Limits)
    compile_limits: Limits = Field(default_factory=default_compile_limits)
    tests: str | None = Field(
        None, max_length=4 << 20,
        description="unit-test code (python, javascript) run by a test driver in a sandbox of "
        "its own: the candidate's top-level functions are reachable from it as proxies that "
        "call across a pipe by value; it passes only if the tests run to their end",
    )
    test_prelude: str | None = Field(
        None, max_length=4 << 20,
        description="trusted task code the driver runs before the tests (e.g. a HumanEval "
        "prompt with its helpers); its definitions take precedence over the candidate's",
    )
    grader_key: str | None = Field(
        None, max_length=128,
        description="executions with the same key may share a pre-started test driver that "
        "forks a fresh copy of itself for each of them (far cheaper than a new interpreter); "
        "the copies share one sandbox, so give one key only to tests from one author (one "
        "environment version). Without a key each execution's driver has a sandbox of its own",
    )
    entry_points: list[str] = Field(
        default_factory=list, max_length=64,
        description="names the tests must reach in the candidate even where the prelude "
        "defines them (a HumanEval prompt's stub of the function under test)",
    )
    cases: list[StdioCase] = Field(
        default_factory=list, max_length=1000,
        description="stdin/stdout cases: compiled once, one sandboxed run per case",
    )
    calls: list[CallCase] = Field(
        default_factory=list, max_length=1000,
        description="function calls graded by value by the supervisor (languages with a call "
        "server: " + ", ".join(CALL_LANGUAGES) + ")",
    )
    trace: TraceOptions | None = None
    read_back: list[str] = Field(
        default_factory=list, max_length=16,
        description="plain file names the program leaves in /work, returned in result.files",
    )

    @field_validator("language")
    @classmethod
    def _known_language(cls, value: str) -> str:
        value = value.lower()
        aliases = {"py": "python", "python3": "python", "js": "javascript", "node": "javascript",
                   "ts": "typescript", "c++": "cpp", "sh": "bash", "golang": "go", "rs": "rust",
                   "rb": "ruby", "lua5.4": "lua"}
        value = aliases.get(value, value)
        if value not in LANGUAGES:
            raise ValueError(f"unknown language {value!r}; known: {', '.join(LANGUAGES)}")
        return value

    @field_validator("files")
    @classmethod
    def _relative_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            parts = name.split("/")
            if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"file name {name!r} must be a plain relative path")
        return value

    @field_validator("read_back")
    @classmethod
    def _plain_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"read_back name {name!r} must be a plain file name")
        return value

    @field_validator("trace")
    @classmethod
    def _trace_is_python_only(
        cls, value: TraceOptions | None, info: ValidationInfo
    ) -> TraceOptions | None:
        if value is not None and info.data.get("language") not in (None, "python"):
            raise ValueError("execution traces are recorded for python only")
        return value

    @field_validator("entry_points")
    @classmethod
    def _identifiers(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name.isidentifier() or name.startswith("__"):
                raise ValueError(f"entry point {name!r} must be a plain identifier")
        return value

    @model_validator(mode="after")
    def _one_way_to_grade(self) -> ExecutionRequest:
        ways = [name for name, given in (("tests", self.tests is not None),
                                         ("cases", bool(self.cases)), ("calls", bool(self.calls)))
                if given]
        if len(ways) > 1:
            raise ValueError(f"grade with one of tests, cases or calls, not {' and '.join(ways)}")
        if self.calls and self.language not in CALL_LANGUAGES:
            raise ValueError(f"calls are graded only for {', '.join(CALL_LANGUAGES)} (other "
                             "languages are graded with stdin/stdout cases)")
        return self

    @field_validator("tests")
    @classmethod
    def _tests_need_harness(cls, value: str | None, info: ValidationInfo) -> str | None:
        language = info.data.get("language")
        if value is not None and language is not None and language not in TEST_LANGUAGES:
            raise ValueError(f"unit-test code runs only for {', '.join(TEST_LANGUAGES)} "
                             "(other languages are graded with stdin/stdout cases)")
        return value


class PhaseResult(BaseModel):
    """What one sandboxed process did."""

    status: Status
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    cpu_ms: int = 0
    wall_ms: int = 0
    supervisor_cpu_ms: float = Field(
        0.0, description="CPU the supervisor spent on this process (counted against cpu_ms)")
    peak_memory_bytes: int = 0
    message: str = ""


class CaseResult(PhaseResult):
    """A run against one stdin/stdout case, with the host's comparison."""

    passed: bool = False


class TraceFrame(BaseModel):
    function: str
    line: int
    locals: dict[str, str] = Field(default_factory=dict)


class TraceEvent(BaseModel):
    event: Literal["call", "line", "return", "exception"]
    function: str
    line: int
    locals: dict[str, str] | None = None


class Trace(BaseModel):
    """Structured feedback an environment can show the model."""

    events: list[TraceEvent] = Field(default_factory=list)
    truncated: bool = False
    exception: str | None = None
    stack: list[TraceFrame] = Field(default_factory=list, description="innermost frame last")

    def render(self, max_lines: int = 60) -> str:
        """A compact text rendering for a prompt."""
        lines = [
            f"{e.event:9} {e.function}:{e.line}"
            + (f"  {', '.join(f'{k}={v}' for k, v in e.locals.items())}" if e.locals else "")
            for e in self.events[:max_lines]
        ]
        if self.truncated or len(self.events) > max_lines:
            lines.append("... (trace truncated)")
        if self.exception:
            lines.append(f"exception: {self.exception}")
            lines.extend(
                f"  at {f.function}:{f.line} {', '.join(f'{k}={v}' for k, v in f.locals.items())}"
                for f in self.stack
            )
        return "\n".join(lines)


class ExecutionResult(PhaseResult):
    """The whole execution: the run phase's fields, plus compile, tests, cases and trace."""

    language: str = ""
    compile: PhaseResult | None = None
    tests_passed: bool | None = Field(
        None, description="None without tests; True only on the test driver's keyed verdict"
    )
    verdict: str | None = Field(
        None, description=f"with tests or cases, how the verdict was reached: one of "
        f"{', '.join(VERDICTS)}")
    verdict_detail: str = Field("", description="the grader's reason, without the tests' text")
    grader: PhaseResult | None = Field(
        None, description="the test driver's own process (its output is not returned)")
    cases: list[CaseResult] = Field(default_factory=list)
    calls: list[CallResult] = Field(default_factory=list)
    trace: Trace | None = None
    files: dict[str, str] = Field(
        default_factory=dict, description="read_back files (regular files only, never links)"
    )
    file_errors: dict[str, str] = Field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Whether the execution counts as a success for scoring."""
        if self.status != Status.OK:
            return False
        if self.tests_passed is not None:
            return self.tests_passed
        if self.cases:
            return all(c.passed for c in self.cases)
        if self.calls:
            return all(c.passed for c in self.calls)
        return True


# --- sessions: workspaces that live across calls (sessions.py) ---------------------------------

class SessionLimits(BaseModel):
    """Quotas of one sandbox session, over its whole life (every command and background
    process together); every field has a safe default."""

    model_config = ConfigDict(extra="forbid")

    cpu_s: int = Field(600, ge=1, le=86_400, description="CPU seconds over the session's life")
    memory_mb: int = Field(512, ge=32, le=65_536,
                           description="RAM of every process, no swap; workspace bytes count too")
    disk_mb: int = Field(256, ge=1, le=65_536, description="what the workspace may add")
    pids: int = Field(128, ge=8, le=4096, description="processes and threads at once")
    wall_s: int = Field(3600, ge=1, le=86_400, description="the session's lifetime")
    idle_s: int = Field(600, ge=1, le=86_400, description="closed after this long without a call")
    tmpfs_mb: int = Field(64, ge=1, le=4096, description="scratch /tmp (not in snapshots)")
    open_files: int = Field(1024, ge=16, le=65_536)
    file_size_mb: int = Field(1024, ge=1, le=65_536, description="largest single file")


DEFAULT_EGRESS_PORTS = (80, 443)
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class EgressRule:
    """One allow-list entry: a DNS name (or `*.suffix`, any name strictly below the suffix) or
    an IP literal, and the ports it opens (80 and 443 when the rule names none)."""

    host: str
    ports: tuple[int, ...]

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches(self, host: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.wildcard:
            return host.endswith(self.host[1:]) and host != self.host[2:]
        return host == self.host

    def __str__(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if self.ports == DEFAULT_EGRESS_PORTS else f"{shown}:{self.ports[0]}"


def normalise_host(host: str) -> str | None:
    """A request's host as rules compare it (lower case, no trailing dot), or None when it is
    neither a DNS name nor an IP literal (a proxy refuses such a name outright)."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) > 253 or len(labels) < 1 or not all(_LABEL.fullmatch(lb) for lb in labels):
        return None
    return host


def parse_egress_rule(raw: str) -> EgressRule:
    """`pypi.org`, `*.example.com:443`, `10.1.2.3:8080`, `[2001:db8::1]:443`; ValueError with
    the reason otherwise."""
    text = raw.strip().lower()
    if not text:
        raise ValueError("an empty rule")
    if "/" in text or "@" in text or "://" in text:
        raise ValueError(f"{raw!r}: give a host and an optional port (`pypi.org`, "
                         "`*.example.com:443`), not a URL or a network")
    port_text = ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{raw!r}: an IPv6 literal is written `[addr]` or `[addr]:port`")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host = text
    ports: tuple[int, ...] = DEFAULT_EGRESS_PORTS
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65_535:
            raise ValueError(f"{raw!r}: the port must be a number from 1 to 65535")
        ports = (int(port_text),)
    wildcard = host.startswith("*.")
    bare = normalise_host(host[2:] if wildcard else host)
    if bare is None or "*" in host[1:]:
        raise ValueError(f"{raw!r}: {host!r} is not a DNS name, `*.name` or an IP literal "
                         "(a wildcard is only the whole first label)")
    if wildcard:
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            pass
        else:
            raise ValueError(f"{raw!r}: a wildcard cannot cover an IP address")
        if "." not in bare:
            raise ValueError(f"{raw!r}: a wildcard must sit below a name of two labels at "
                             "least (`*.example.com`, not `*.com`)")
    return EgressRule(host=f"*.{bare}" if wildcard else bare, ports=ports)


class EgressPolicy(BaseModel):
    """Outbound HTTP(S) a session may make, through the engine's proxy only (docs/sandbox.md,
    Egress): hosts on `allow`, each name resolved and checked on the host (private, loopback
    and link-local addresses are refused unless the operator opened them), within the
    connection and byte caps. A session without a policy has no network at all."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(min_length=1, max_length=64, description=(
        "`host`, `*.suffix` or an IP literal, with an optional `:port` (default 80 and 443)"))
    max_connections: int = Field(16, ge=1, le=256, description="open through the proxy at once")
    max_mb: int = Field(512, ge=1, le=65_536, description="bytes both ways, over the session")
    idle_timeout_s: int = Field(60, ge=1, le=3600, description="a silent connection is closed")

    @field_validator("allow")
    @classmethod
    def _rules(cls, value: list[str]) -> list[str]:
        out: list[str] = []
        for i, raw in enumerate(value):
            try:
                rule = parse_egress_rule(raw)
            except ValueError as exc:
                raise ValueError(f"allow[{i}]: {exc}") from None
            if str(rule) not in out:
                out.append(str(rule))
        return out

    def rules(self) -> tuple[EgressRule, ...]:
        return tuple(parse_egress_rule(raw) for raw in self.allow)

    def match(self, host: str, port: int) -> EgressRule | None:
        return next((r for r in self.rules() if r.matches(host, port)), None)


class SessionStatus(StrEnum):
    """How one exec in a session ended."""

    OK = "OK"  # exit status 0
    RE = "RE"  # non-zero exit status or a signal
    TLE = "TLE"  # the call's timeout: its process group was killed
    OLE = "OLE"  # more output than output_bytes: killed
    MLE = "MLE"  # the session's memory quota: the kernel killed a process of the command
    PIDS = "PIDS"  # the session's process quota was reached: every process but the agent killed
    DISK = "DISK"  # the command failed with the workspace full
    CPU = "CPU"  # the session's CPU quota is spent: the session is closed
    LOST = "LOST"  # the session ended during the call (closed, expired, idle, engine failure)


class SessionExec(BaseModel):
    """One command for a session: `bash -c cmd` in /work."""

    model_config = ConfigDict(extra="forbid")

    cmd: str = Field(min_length=1, max_length=100_000)
    timeout_s: float = Field(30.0, gt=0, le=3600)
    stdin: str = Field("", max_length=16 << 20)
    env: dict[str, str] = Field(default_factory=dict)
    background: bool = Field(False, description="start it and return its pid at once")
    output_bytes: int = Field(1 << 20, ge=0, le=16 << 20, description="stdout + stderr")
