"""The sandbox health probe against the real sandbox: healthy here, and failing with a reason
a person can act on when the sandbox is really broken (bubblewrap pointed at a missing binary,
or at one that fails; a toolchain folder that is not there). The broken cases run in a fresh
interpreter because the engine reads those settings once, at import, as a worker does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skips import sandbox_unavailable
from workers.envs.spec import sandbox_languages
from workers.sandbox import health

ROOT = Path(__file__).resolve().parents[3]
PROBE = ("import json, sys\nfrom workers.sandbox import health\n"
         "found = health.probe_or_rebuild(sys.argv[1:])\n"
         "print(json.dumps({k: [c.ok, c.detail] for k, c in found.items()}))")


@pytest.fixture(autouse=True)
def _sandbox() -> None:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)


def probe_in_child(env: dict[str, str], *languages: str) -> dict[str, list]:
    done = subprocess.run([sys.executable, "-c", PROBE, *languages], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_healthy_host_passes_python_and_a_compiled_language() -> None:
    found = health.probe(["python", "c"])
    assert found == {"python": health.Check(True), "c": health.Check(True)}


def test_missing_bubblewrap_fails_every_language_naming_the_fix(tmp_path: Path) -> None:
    found = probe_in_child({"CRUCIBLE_SANDBOX_BWRAP": str(tmp_path / "bwrap")}, "python", "c")
    assert set(found) == {"python", "c"}
    for ok, detail in found.values():
        assert ok is False
        assert f"{tmp_path / 'bwrap'} is missing" in detail
        assert "install_sandbox_deps.sh" in detail


def test_a_bubblewrap_that_fails_fails_the_probe() -> None:
    found = probe_in_child({"CRUCIBLE_SANDBOX_BWRAP": "/bin/false"}, "python")
    assert found["python"][0] is False
    assert "python: the sandbox probe ended" in found["python"][1]


def test_a_missing_toolchain_fails_only_its_language(tmp_path: Path) -> None:
    found = probe_in_child({"CRUCIBLE_SANDBOX_TOOLCHAINS": str(tmp_path / "none")},
                           "typescript", "python")
    assert found["python"] == [True, ""]
    assert found["typescript"][0] is False
    assert "toolchain not found" in found["typescript"][1]


def test_an_unknown_language_is_not_healthy() -> None:
    assert health.probe(["cobol"]) == {
        "cobol": health.Check(False, "cobol: no such sandbox language")}


def test_the_languages_an_environment_needs() -> None:
    assert sandbox_languages({"source": "builtin", "name": "arithmetic"}) == frozenset()
    assert sandbox_languages({"env": {"source": "builtin", "name": "humaneval"}}) == {"python"}
    assert sandbox_languages({"source": "builtin", "name": "math",
                              "params": {"tools": ["python"]}}) == {"python"}
    tasks = {"source": "tasks", "tasks": [{"id": "t", "prompt": "p", "answer": "1"}],
             "rubric": {"components": [
                 {"name": "io", "checker": "stdio_cases", "params": {"language": "c"}},
                 {"name": "mix", "checker": "weighted", "params": {"checkers": [
                     {"checker": "call_cases", "weight": 1, "params": {"language": "ruby"}},
                     {"checker": "exact_match", "weight": 1}]}}]}}
    assert sandbox_languages(tasks) == {"c", "ruby"}
    assert sandbox_languages({"source": "nonsense"}) == frozenset()
