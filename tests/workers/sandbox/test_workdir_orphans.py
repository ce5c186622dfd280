"""Work directories a killed supervisor left mounted are swept by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skips import host_reason
from workers.sandbox import workdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason=host_reason("mounting tmpfs work dirs needs root"))

CREATE = """
import sys, time
from workers.sandbox import workdir
path = workdir.create({"a.txt": "x"}, owner_uid=65534, owner_gid=65534, size_bytes=1 << 20)
print(path, flush=True)
time.sleep(60)
"""


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text()
               .splitlines())


def test_a_killed_supervisors_tmpfs_is_unmounted_and_removed(tmp_path, monkeypatch):
    base = tmp_path / "workdirs"
    env = {**os.environ, "CRUCIBLE_SANDBOX_WORKDIRS": str(base)}
    dead = subprocess.Popen([sys.executable, "-c", CREATE], env=env, stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[3])
    orphan = Path(dead.stdout.readline().strip())
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert orphan.name.startswith(f"w-{dead.pid}-") and _mounted(orphan)

    monkeypatch.setattr(workdir, "BASE", base)
    monkeypatch.setattr(workdir, "_base_ready", False)  # as in a fresh supervisor process
    mine = workdir.create({}, owner_uid=65534, owner_gid=65534, size_bytes=1 << 20)
    try:
        assert workdir.sweep_orphans(base) == []  # already swept by the first create
        assert not _mounted(orphan) and not orphan.exists()
        assert mine.name.startswith(f"w-{os.getpid()}-") and _mounted(mine)
        # A live supervisor's directory is never swept.
        assert workdir.sweep_orphans(base) == [] and _mounted(mine)
    finally:
        workdir.remove(mine)
