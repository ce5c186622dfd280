"""The trusted grader of terminal tasks: hidden tests in a fork of the final workspace.

The policy's session is never graded in place. `grade_session` snapshots it (processes frozen
while the workspace is copied), closes it (every process it started, background ones too, is
killed with its cgroup), forks the snapshot into a fresh session (a new sandbox, a new uid, no
process of the episode) and runs the trusted runner there: `/usr/bin/python3 -I -S` by
absolute path with a clean environment, its source, the hidden tests and a nonce on stdin
(no file the workspace could have planted or could replace). The runner's verdict comes back on
a pipe only it holds (harness/runner.py says how); a verdict without the nonce, or
anything but one JSON line, is a grading failure, never a pass.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from workers.envs.base import Score
from workers.sandbox.sessions import Session, SessionClosed, SessionError, SessionManager
from workers.sandbox.spec import SessionExec, SessionLimits, SessionStatus

PYTHON = "/usr/bin/python3"
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8",
             "TERM": "dumb"}
_BOOT = ("import json,sys;m=json.loads(sys.stdin.buffer.read());"
         "exec(compile(m.pop('runner'),'crucible-test-runner','exec'),{'MSG':m})")
GRADER_LIMITS = SessionLimits(cpu_s=600, memory_mb=1024, disk_mb=512, pids=256, wall_s=3600,
                              idle_s=600)


def platform_closed(reason: str) -> bool:
    """Whether a session closed for the platform's sake: lost (engine failure), idle (reclaimed
    while the policy was still generating) or its manager shut down. A spent CPU quota or
    lifetime is the episode's own doing."""
    return reason.startswith(("lost", "idle", "manager closed"))


def runner_source() -> str:
    return (resources.files("workers.envs.terminal") / "harness" / "runner.py").read_text()


@dataclass
class GradeResult:
    """What the hidden tests said. `reward` is 1.0 only when every test passed; `error` is set
    when grading itself failed (the sandbox, not the policy: `infra` tells which)."""

    reward: float
    passed: int = 0
    total: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""
    error: str | None = None
    infra: bool = False

    def as_score(self) -> Score:
        """The grade as an environment Score: an infrastructure failure is flagged (`infra`),
        so the RL engine retries or drops it instead of training on its 0."""
        return Score(self.reward, {"hidden_tests": self.reward}, info=self.as_json(),
                     infra=(self.error or "grading failed") if self.infra else None)

    def as_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "passed": self.passed, "total": self.total,
                "results": self.results, "output": self.output, "error": self.error,
                "infra": self.infra}


def run_tests(session: Session, tests: dict[str, str], timeout_s: float,
              per_test_s: float | None = None) -> GradeResult:
    """Run `tests` with the runner in `session` (for the hidden tests: a session no policy
    process lives in; the visible-tests tool uses it on the policy's own)."""
    nonce = secrets.token_hex(16)
    message = {"runner": runner_source(), "tests": tests, "nonce": nonce,
               "per_test_s": per_test_s or timeout_s}
    request = SessionExec(cmd=f"exec {PYTHON} -I -S -c \"{_BOOT}\"", timeout_s=timeout_s,
                          stdin=json.dumps(message), env=dict(CLEAN_ENV),
                          output_bytes=4 << 20)
    try:
        result = session.exec(request)
    except SessionClosed as exc:
        return GradeResult(0.0, error=f"the grading session closed: {exc.reason}", infra=True)
    if result.status in (SessionStatus.LOST, SessionStatus.CPU):
        return GradeResult(0.0, error=f"the grading session ended: {result.message}", infra=True)
    if result.status == SessionStatus.TLE:
        return GradeResult(0.0, error=f"the tests took longer than {timeout_s:g} s")
    lines = result.stdout.strip().split(b"\n")
    try:
        verdict = json.loads(lines[-1]) if len(lines) == 1 else None
    except json.JSONDecodeError:
        verdict = None
    if not isinstance(verdict, dict) or verdict.get("nonce") != nonce:
        return GradeResult(0.0, error=f"the test runner gave no verdict ({result.status}: "
                                      f"{result.stderr[-500:].decode(errors='replace')})")
    results = [r for r in verdict.get("results", []) if isinstance(r, dict)]
    passed = sum(1 for r in results if r.get("outcome") == "passed")
    if not results:
        return GradeResult(0.0, results=results, output=str(verdict.get("output", "")),
                           error="the tests define no test function")
    return GradeResult(1.0 if passed == len(results) else 0.0, passed=passed,
                       total=len(results), results=results, output=str(verdict.get("output", "")))


def grade_snapshot(manager: SessionManager, snapshot_id: str, tests: dict[str, str],
                   timeout_s: float, limits: SessionLimits | None = None) -> GradeResult:
    """Hidden tests in a fresh fork of a workspace snapshot; the fork is closed after."""
    try:
        grader = manager.fork(snapshot_id, limits or GRADER_LIMITS)
    except (SessionError, OSError) as exc:
        return GradeResult(0.0, error=f"could not fork the final workspace: {exc}", infra=True)
    try:
        return run_tests(grader, tests, timeout_s)
    finally:
        grader.close("graded")


def grade_session(session: Session, tests: dict[str, str], timeout_s: float,
                  limits: SessionLimits | None = None) -> GradeResult:
    """Grade the final state of the policy's session: snapshot it, close it (its processes
    die), grade a fork of the snapshot, drop the snapshot."""
    manager = session.manager
    try:
        snap = session.snapshot()
    except SessionClosed as exc:
        # lost (engine failure) or idle (reclaimed while the policy was still generating) is
        # the platform's doing; a spent CPU quota or lifetime is the episode's own
        return GradeResult(0.0, error=f"the episode's session closed before grading: "
                                      f"{exc.reason}",
                           infra=platform_closed(exc.reason))
    except (SessionError, OSError) as exc:
        return GradeResult(0.0, error=f"could not snapshot the final workspace: {exc}",
                           infra=True)
    try:
        session.close("episode over")
        return grade_snapshot(manager, snap, tests, timeout_s, limits)
    finally:
        manager.drop_snapshot(snap)
