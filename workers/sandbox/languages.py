"""The language table: source file, compile and run commands, and toolchain detection.

Toolchains are found at absolute paths the unprivileged sandbox user can read (a rustup install
under /root cannot be), so availability is decided by what is installed system-wide, and a missing
toolchain is reported with the Debian or npm package that provides it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .harness import source as harness_source

TOOLCHAINS_DIR = Path(
    os.environ.get("CRUCIBLE_SANDBOX_TOOLCHAINS", "/opt/crucible/sandbox-toolchains")
)
"""Host folder of npm-installed toolchains (TypeScript), outside any checkout so the sandbox user
can read it wherever the repo is cloned (not under /root); mounted read-only at TOOLCHAINS_MOUNT."""
TOOLCHAINS_MOUNT = "/opt/crucible-toolchains"


@dataclass(frozen=True)
class Language:
    """How to build and run one language inside a sandbox (paths are sandbox paths)."""

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    requires: tuple[str, ...] = ()  # host paths that must exist
    install_hint: str = ""
    env: dict[str, str] = field(default_factory=dict)
    warm: bool = False  # a warm pool of pre-started interpreters can serve it
    binds: tuple[tuple[str, str], ...] = ()  # extra read-only (host, sandbox) mounts
    serve: tuple[str, ...] | None = None
    """The call server's argv ({LINK_IN} / {LINK_OUT}: the pipes to and from the supervisor),
    for languages graded with `calls` that have no warm bootstrap (Python and Node serve calls
    from theirs)."""

    def missing(self) -> list[str]:
        """Host paths this language needs that are absent or unreadable to other users."""
        return [p for p in self.requires if not _world_usable(Path(p))]

    @property
    def available(self) -> bool:
        return not self.missing()


def _world_usable(path: Path) -> bool:
    """Exists, and every directory on the way is traversable by "other" (the sandbox user)."""
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return False
    for parent in [*reversed(resolved.parents), resolved]:
        mode = parent.stat().st_mode
        if parent != resolved and not mode & 0o001:
            return False
    return bool(resolved.stat().st_mode & 0o004)


_TSC = f"{TOOLCHAINS_MOUNT}/typescript/node_modules/typescript/bin/tsc"
_LINKS = ("{LINK_IN}", "{LINK_OUT}")

LANGUAGE_TABLE: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language(
            "python", "main.py", ("/usr/bin/python3", "-I", "main.py"),
            requires=("/usr/bin/python3",), install_hint="apt-get install python3", warm=True,
        ),
        Language(
            "c", "main.c", ("./main",),
            compile=("/usr/bin/gcc", "-O2", "-std=gnu17", "-pipe", "-o", "main", "main.c", "-lm"),
            requires=("/usr/bin/gcc",), install_hint="apt-get install gcc",
        ),
        Language(
            "cpp", "main.cpp", ("./main",),
            compile=("/usr/bin/g++", "-O2", "-std=gnu++17", "-pipe", "-o", "main", "main.cpp"),
            requires=("/usr/bin/g++",), install_hint="apt-get install g++",
        ),
        Language(
            "javascript", "main.js", ("/usr/bin/node", "main.js"),
            requires=("/usr/bin/node",), install_hint="apt-get install nodejs", warm=True,
        ),
        Language(
            "typescript", "main.ts", ("/usr/bin/node", "main.js"),
            compile=(
                "/usr/bin/node", _TSC, "--target", "es2020", "--module", "commonjs",
                "--lib", "es2020,dom", "--strict", "false", "--pretty", "false", "main.ts",
            ),
            requires=("/usr/bin/node",
                      str(TOOLCHAINS_DIR / "typescript/node_modules/typescript/bin/tsc")),
            install_hint="scripts/install_sandbox_deps.sh (npm install typescript under "
            f"{TOOLCHAINS_DIR}/typescript)",
            binds=((str(TOOLCHAINS_DIR), TOOLCHAINS_MOUNT),),
        ),
        Language(
            "bash", "main.sh", ("/bin/bash", "main.sh"),
            requires=("/bin/bash",), install_hint="apt-get install bash",
        ),
        Language(
            "rust", "main.rs", ("./main",),
            compile=("/usr/bin/rustc", "-O", "-o", "main", "main.rs"),
            requires=("/usr/bin/rustc",), install_hint="apt-get install rustc",
        ),
        Language(
            "java", "Main.java",
            ("/usr/bin/java", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss64m", "-cp", ".",
             "Main"),
            compile=("/usr/bin/javac", "-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1",
                     "-encoding", "UTF-8", "Main.java"),
            requires=("/usr/bin/javac", "/usr/bin/java"),
            install_hint="apt-get install default-jdk-headless",
        ),
        Language(
            # without RubyGems: it takes ~70 ms to load and the sandbox installs no gems
            "ruby", "main.rb", ("/usr/bin/ruby", "--disable-gems", "main.rb"),
            requires=("/usr/bin/ruby",), install_hint="apt-get install ruby",
            serve=("/usr/bin/ruby", "--disable-gems", "-e", harness_source("ruby_serve.rb"),
                   *_LINKS),
        ),
        Language(
            "php", "main.php", ("/usr/bin/php", "-n", "main.php"),
            requires=("/usr/bin/php",), install_hint="apt-get install php-cli",
            serve=("/usr/bin/php", "-n", "-r", harness_source("php_serve.php"), *_LINKS),
        ),
        Language(
            "lua", "main.lua", ("/usr/bin/lua5.4", "main.lua"),
            requires=("/usr/bin/lua5.4",), install_hint="apt-get install lua5.4",
            # lua takes its first bare argument as a script, so the fds go in as a global; and
            # it refuses a separate `-e` argument that starts with '-': attach the source
            serve=("/usr/bin/lua5.4", "-e", "CRUCIBLE_LINKS = {'{LINK_IN}', '{LINK_OUT}'}",
                   "-e" + harness_source("lua_serve.lua")),
        ),
        Language(
            "go", "main.go", ("./main",),
            # compile + link against the distribution's prebuilt standard library: `go build`
            # with an empty build cache would rebuild the runtime each time (seconds).
            compile=("/bin/bash", "-c", "/usr/bin/go tool compile -o main.o main.go"
                     " && /usr/bin/go tool link -o main main.o"),
            requires=("/usr/bin/go",), install_hint="apt-get install golang-go",
            env={"GOCACHE": "/tmp/go-cache", "GOPATH": "/tmp/go", "GO111MODULE": "off",
                 "CGO_ENABLED": "0"},
        ),
    )
}


class ToolchainMissing(RuntimeError):
    """The language is known but its toolchain is not installed where the sandbox can use it."""


_CHECK_TTL_S = 10.0
_checked: dict[tuple[str, ...], tuple[float, list[str]]] = {}
_checked_lock = threading.Lock()


def _missing_cached(lang: Language) -> list[str]:
    """lang.missing(), remembered for a few seconds: resolving and stat-ing every directory of
    every toolchain path on each request cost more supervisor CPU than writing its files. A
    toolchain installed or removed meanwhile is noticed within the TTL."""
    now = time.monotonic()
    with _checked_lock:
        hit = _checked.get(lang.requires)
    if hit is not None and hit[0] > now:
        return hit[1]
    missing = lang.missing()
    with _checked_lock:
        _checked[lang.requires] = (now + _CHECK_TTL_S, missing)
    return missing


def get(name: str, table: dict[str, Language] | None = None) -> Language:
    """The language, or ToolchainMissing naming what to install."""
    lang = (LANGUAGE_TABLE if table is None else table).get(name)
    if lang is None:
        raise ToolchainMissing(f"unknown language {name!r}")
    missing = _missing_cached(lang)
    if missing:
        raise ToolchainMissing(
            f"{name}: toolchain not found or not readable by the sandbox user "
            f"({', '.join(missing)}); install it: {lang.install_hint}"
        )
    return lang


def available() -> dict[str, bool]:
    """Which languages this host can run right now."""
    return {name: lang.available for name, lang in LANGUAGE_TABLE.items()}
