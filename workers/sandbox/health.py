"""The sandbox's health probe: can this host run a language's programs in the sandbox now?

A broken sandbox does not fail loudly: bubblewrap missing or refusing to start, a toolchain
removed, a helper binary gone all turn every execution into ``SANDBOX_ERROR``, which a code
checker scores 0, so a training run would go on learning from rewards that mean nothing. A
worker therefore probes the languages a run's environments need before it starts the run (and
again after the run fails), and the node agent probes at start and when the control plane asks
(``NodeStatus.recheck``), reporting what it found in its heartbeat.

A probe is real: it compiles (where the language compiles) and runs a hello-world in a fresh
sandbox through the same engine code as every execution, with no warm pool, and checks its
output. :func:`rebuild` clears what the engine caches about the host (toolchain lookups, the
bubblewrap command prefix, the resolved helper binaries, the process-wide engine's warm pools)
so that the next probe sees the host as it is now, and rebuilds the helpers if they are gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from . import gate, languages, runner
from .languages import ToolchainMissing
from .policy import bwrap
from .spec import ExecutionRequest, Limits, Status

log = logging.getLogger(__name__)

EXPECTED = "crucible-ok"
HELLO: dict[str, str] = {
    "python": 'print("crucible-ok")',
    "c": '#include <stdio.h>\nint main(void) { puts("crucible-ok"); return 0; }\n',
    "cpp": '#include <cstdio>\nint main() { std::puts("crucible-ok"); return 0; }\n',
    "javascript": 'console.log("crucible-ok");',
    "typescript": 'const word: string = "crucible-ok";\nconsole.log(word);\n',
    "bash": "echo crucible-ok",
    "rust": 'fn main() { println!("crucible-ok"); }\n',
    "java": 'public class Main { public static void main(String[] a) { '
            'System.out.println("crucible-ok"); } }\n',
    "ruby": 'puts "crucible-ok"',
    "php": '<?php echo "crucible-ok\\n";',
    "lua": 'print("crucible-ok")',
    "go": 'package main\nimport "fmt"\nfunc main() { fmt.Println("crucible-ok") }\n',
}
"""One program per language of the table: it prints EXPECTED and exits 0."""

# Roomy: a JVM or rustc on a loaded host is slow, and a probe must not fail for being slow.
PROBE_LIMITS = Limits(wall_ms=60_000, cpu_ms=30_000, memory_mb=1024, pids=128)
DETAIL_MAX = 500


@dataclass(frozen=True)
class Check:
    """One language's probe: ``ok``, else ``detail`` says what failed and how to fix it."""

    ok: bool
    detail: str = ""


def _one(engine: runner.Engine, language: str) -> Check:
    code = HELLO.get(language)
    if code is None:
        return Check(False, f"{language}: no such sandbox language")
    try:
        languages.get(language)
    except ToolchainMissing as exc:
        return Check(False, str(exc)[:DETAIL_MAX])
    result = engine.execute(ExecutionRequest(language=language, code=code, limits=PROBE_LIMITS))
    if result.status == Status.OK and result.stdout.strip() == EXPECTED:
        return Check(True)
    said = " ".join(p.strip() for p in (result.message, result.stderr, result.stdout)
                    if p.strip())
    detail = f"{language}: the sandbox probe ended {result.status}" + (f": {said}" if said
                                                                        else "")
    return Check(False, detail[:DETAIL_MAX])


def probe(wanted: Iterable[str]) -> dict[str, Check]:
    """Probe each language in ``wanted`` in a fresh engine (no warm pools: what a pool
    started earlier could hide is exactly what is being checked)."""
    names = sorted(set(wanted))
    if not names:
        return {}
    engine = runner.Engine(runner.EngineConfig(warm_languages=()))
    try:
        return {name: _one(engine, name) for name in names}
    finally:
        engine.close()


_rebuild_lock = threading.Lock()


def rebuild() -> None:
    """Forget what this process cached about the host's sandbox, so the next execution and
    probe look again: toolchain lookups, the bubblewrap prefix (built once from /etc), the
    resolved helper binaries (rebuilt on next use if missing), and the process-wide engine
    with its warm sandboxes (closed; the next use starts a new one)."""
    with _rebuild_lock:
        with languages._checked_lock:
            languages._checked.clear()
        bwrap._system_prefix.cache_clear()
        with gate._lock:
            gate._resolved.clear()
        with runner._default_lock:
            old, runner._default = runner._default, None
        if old is not None:
            old.close()
    log.info("sandbox state cleared: the next probe and executions look at the host afresh")


def probe_or_rebuild(wanted: Iterable[str]) -> dict[str, Check]:
    """Probe; if anything fails, rebuild and probe once more (stale cached state heals
    itself; a host that is really broken fails twice)."""
    names = sorted(set(wanted))
    found = probe(names)
    if all(c.ok for c in found.values()):
        return found
    rebuild()
    return probe(names)
