"""The sandbox part of code items: expected outputs from the reference, then the oracle check.

Logic stage of a code task: (1) the reference runs on every test input in the sandbox and must
exit cleanly with output, which becomes the expected stdout; (2) the independent oracle solution
runs on the same inputs in the sandbox and must reproduce every expected output.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from .code_tasks import CodeBuilt
from .items import Outcome

LIMITS = {"wall_ms": 10_000, "cpu_ms": 5_000, "memory_mb": 256}


def sandbox_unavailable() -> str | None:
    """Why the sandbox engine cannot run here, or None."""
    if os.geteuid() != 0:
        return "the sandbox engine runs as root (cgroups, dropping to the sandbox uid)"
    if not shutil.which("bwrap"):
        return "bubblewrap is missing: run scripts/install_sandbox_deps.sh (apt: bubblewrap)"
    from workers.sandbox import cgroups

    try:
        cgroups.backend()
    except cgroups.CgroupError as exc:
        return str(exc)
    return None


def run_code_stage(
    pairs: Sequence[tuple[Outcome, CodeBuilt]], engine: Any, concurrency: int,
    progress: Callable[[int], None], chunk: int = 8,
) -> None:
    """Finish every (outcome, built) pair in place: expected outputs, then the oracle."""
    from workers.sandbox.scoring import stdio_request
    from workers.sandbox.spec import Limits, Status, StdioCase

    limits = Limits(**LIMITS)
    done = 0
    for start in range(0, len(pairs), chunk):
        part = pairs[start:start + chunk]
        refs = engine.execute_batch(
            [stdio_request("python", b.reference,
                           [StdioCase(stdin=s, expected_stdout="") for s in b.inputs], limits)
             for _, b in part], concurrency=concurrency)
        survivors: list[tuple[Outcome, CodeBuilt]] = []
        for (out, built), result in zip(part, refs, strict=True):
            if result.status == Status.SANDBOX_ERROR:
                out.reject("logic", "logic:sandbox_error", result.message)
                continue
            bad = next((i for i, c in enumerate(result.cases)
                        if c.status != Status.OK or not c.stdout.strip()), None)
            if bad is not None:
                case = result.cases[bad]
                out.reject("logic", "logic:reference_failed",
                           f"test {bad}: {case.status} {case.message} {case.stderr[-300:]}".strip())
                continue
            for test, case in zip(out.record["tests"], result.cases, strict=True):
                test["expected_stdout"] = case.stdout
            out.passed("logic", "reference_ran", f"{len(result.cases)} expected outputs from the "
                       "reference in the sandbox")
            survivors.append((out, built))
        oracles = engine.execute_batch(
            [stdio_request("python", b.oracle,
                           [StdioCase(stdin=t["stdin"], expected_stdout=t["expected_stdout"])
                            for t in out.record["tests"]], limits)
             for out, b in survivors], concurrency=concurrency)
        for (out, _), result in zip(survivors, oracles, strict=True):
            if result.status == Status.SANDBOX_ERROR:
                out.reject("logic", "logic:sandbox_error", result.message)
                continue
            failed = [i for i, c in enumerate(result.cases) if not c.passed]
            if failed:
                case = result.cases[failed[0]]
                out.reject("logic", "logic:oracle_disagrees",
                           f"{len(failed)}/{len(result.cases)} tests differ; test {failed[0]}: "
                           f"oracle printed {case.stdout[:120]!r} ({case.status})")
                continue
            out.passed("logic", "oracle_agrees",
                       f"independent oracle passed {len(result.cases)}/{len(result.cases)} tests "
                       "in the sandbox")
        done += len(part)
        progress(done)
