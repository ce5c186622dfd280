"""Under CI=true a test skipped for a missing installable dependency fails the run; host skips
(no GPU, no cgroup controllers, the other pass's tests) stay skips (tests/skips.py). Checked by
running pytest with the plugin on a throwaway test module, with and without CI=true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest
from tests.skips import host_reason, host_skip

def test_needs_a_browser():
    pytest.skip("Debian's chromium is not installed")

def test_needs_a_gpu():
    host_skip("no CUDA GPU on this host")

@pytest.mark.skipif(True, reason=host_reason("REDIS_URL is not set in this pass"))
def test_redis_only():
    pass

@pytest.mark.skipif(True, reason="bubblewrap missing")
def test_needs_bubblewrap():
    pass

@pytest.mark.xfail(reason="a known bug, not a skip")
def test_known_bug():
    assert False

def test_passes():
    pass
'''
IMPORT_SKIPPED = 'import pytest\npytest.importorskip("no_such_package_for_crucible")\n'


def _run(tmp_path: Path, ci: str | None) -> tuple[int, str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_module_skip.py").write_text(IMPORT_SKIPPED)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.skips", "-p", "no:django",
         "-p", "no:cacheprovider", "-rA", "-q", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _counts(out: str) -> dict[str, int]:
    tail = out.strip().splitlines()[-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", tail)}


def test_outside_ci_every_skip_stays_a_skip(tmp_path):
    rc, out = _run(tmp_path, None)
    assert rc == 0, out
    assert _counts(out) == {"passed": 1, "skipped": 5, "xfailed": 1}, out


@pytest.mark.parametrize("value", ["true", "1"])
def test_under_ci_a_missing_dependency_fails_and_host_skips_stay(tmp_path, value):
    rc, out = _run(tmp_path, value)
    assert rc == 1, out
    # A skip in the test fails it, a skip mark fails its setup (an error); the module skipped at
    # import still counts as skipped but fails the session, and the other tests all ran.
    assert _counts(out) == {"failed": 1, "error": 1, "passed": 1, "skipped": 3,
                            "xfailed": 1}, out
    assert re.search(r"FAILED .*test_needs_a_browser", out)
    assert re.search(r"ERROR .*test_needs_bubblewrap", out)
    assert re.search(r"FAILED \(module skipped\) test_module_skip.py: CI=true", out)
    assert "CI=true: skipped for a missing dependency that `make test` installs: " \
           "Skipped: Debian's chromium is not installed" in out
    assert "no_such_package_for_crucible" in out
    assert re.search(r"SKIPPED .*host: no CUDA GPU on this host", out)
    assert re.search(r"SKIPPED .*host: REDIS_URL is not set in this pass", out)
