"""Per-execution cgroups and safe read-back of work-directory files (host side, as root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from workers.sandbox import cgroups, workdir


@pytest.fixture
def backend(engine: object) -> type[cgroups.Cgroup]:  # engine: skips where sandboxes cannot run
    return cgroups.backend()


def test_limits_are_written_and_teardown_kills_everything(backend: type[cgroups.Cgroup]) -> None:
    group = cgroups.create(memory_bytes=64 << 20, pids=7)
    try:
        if isinstance(group, cgroups.CgroupV1):
            mem = group.dirs["memory"]
            assert int((mem / "memory.limit_in_bytes").read_text()) == 64 << 20
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                assert int(memsw.read_text()) == 64 << 20  # no swap on top of RAM
            assert (group.dirs["pids"] / "pids.max").read_text().strip() == "7"
        else:
            assert isinstance(group, cgroups.CgroupV2)
            assert int((group.dir / "memory.max").read_text()) == 64 << 20
            assert (group.dir / "pids.max").read_text().strip() == "7"
        sleeper = subprocess.Popen(["sleep", "600"])
        group.add(sleeper.pid)
        assert group.procs() == [sleeper.pid]
        group.kill()
        assert sleeper.wait(timeout=10) == -9
        assert group.procs() == []
    finally:
        group.remove()
    if isinstance(group, cgroups.CgroupV1):
        assert not any(path.exists() for path in group.dirs.values())


def test_stale_cgroups_of_dead_supervisors_are_removed(backend: type[cgroups.Cgroup]) -> None:
    stale = cgroups.backend()("999999999-0-dead")  # beyond pid_max: that owner never lives
    assert cgroups.remove_stale() >= 1
    paths = stale.dirs.values() if isinstance(stale, cgroups.CgroupV1) else [stale.dir]
    assert not any(Path(p).exists() for p in paths)


def test_read_back_refuses_links_fifos_directories_and_paths(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("x" * 100)
    os.symlink("/etc/hostname", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    assert workdir.read(tmp_path, "ok.txt") == b"x" * 100
    assert workdir.read(tmp_path, "ok.txt", limit=10) == b"x" * 10
    for name in ("link", "fifo", "dir", "../etc/hostname", "..", "missing"):
        with pytest.raises(workdir.UnsafeFile):
            workdir.read(tmp_path, name)
