"""Per-execution cgroups and safe read-back of work-directory files (host side, as root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.skips import host_skip
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


def test_a_busy_cgroup_runs_on_busy_once_then_is_removed(backend: type[cgroups.Cgroup]) -> None:
    """A member that is still there at removal (on v1 an unreaped zombie is one) makes rmdir
    fail with EBUSY; the hook (the engine's zombie sweep) runs, then the removal succeeds."""
    group = cgroups.create(memory_bytes=64 << 20, pids=7)
    sleeper = subprocess.Popen(["sleep", "600"])
    group.add(sleeper.pid)
    calls: list[int] = []

    def on_busy() -> None:
        calls.append(sleeper.pid)
        sleeper.kill()
        sleeper.wait(timeout=10)
        cgroups.wait_exited({sleeper.pid}, 5.0)

    try:
        group.remove(on_busy=on_busy)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert calls[:1] == [sleeper.pid]  # (v1: again per hierarchy only if still busy there)
    paths = group.dirs.values() if isinstance(group, cgroups.CgroupV1) else [group.dir]
    assert not any(Path(p).exists() for p in paths)


def test_wait_exited_returns_once_killed_processes_are_dead() -> None:
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    for proc in sleepers:
        proc.kill()
    cgroups.wait_exited({p.pid for p in sleepers}, 30.0)
    # dead (zombies until reaped): a non-blocking wait reaps each of them at once
    assert all(os.waitpid(p.pid, os.WNOHANG)[0] == p.pid for p in sleepers)
    for proc in sleepers:
        proc.returncode = -9  # reaped above


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


# -- cgroup v2 --------------------------------------------------------------------------------
# These VMs have no v2 memory/pids controllers, so the v2 backend is exercised two ways: against a
# temporary directory laid out like a cgroup2 hierarchy (what it writes, what it parses), and on
# real v2 controllers where a host has them (skipped here, with the reason).

MEMORY_EVENTS = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n"
CPU_STAT = "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n"


def test_keyed_files_and_oom_detection_are_parsed() -> None:
    assert cgroups.parse_keyed(MEMORY_EVENTS)["oom_kill"] == 1
    assert cgroups.parse_keyed(CPU_STAT) == {"usage_usec": 1500, "user_usec": 1000,
                                             "system_usec": 500, "nr_periods": 0}
    assert cgroups.parse_keyed("populated 1\nbogus\nx y z\n") == {"populated": 1}
    assert cgroups.oom_killed(cgroups.parse_keyed(MEMORY_EVENTS))
    assert cgroups.oom_killed({"oom_group_kill": 1})
    assert not cgroups.oom_killed(cgroups.parse_keyed("max 40\noom 0\noom_kill 0\n"))
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"  # v1 memory.oom_control
    assert cgroups.oom_killed(cgroups.parse_keyed(v1))


def _cgroup2_tree(root: Path, controllers: str) -> Path:
    """A cgroup2 mount as the kernel presents it: the files exist, writes just store text."""
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / cgroups.GROUP).mkdir()
    (root / cgroups.GROUP / "cgroup.subtree_control").write_text("")
    return root / cgroups.GROUP


def _execution_dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir()
    for file in ("memory.max", "memory.swap.max", "memory.oom.group", "pids.max", "cgroup.procs",
                 "cgroup.kill"):
        (path / file).write_text("")
    (path / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    (path / "memory.events").write_text(MEMORY_EVENTS)
    (path / "memory.peak").write_text("123456789\n")
    (path / "cpu.stat").write_text(CPU_STAT)
    return path


def test_v2_parent_enables_controllers_top_down(tmp_path: Path) -> None:
    parent = _cgroup2_tree(tmp_path, "cpuset cpu io memory hugetlb pids rdma misc")
    assert cgroups.v2_parent(tmp_path) == parent
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    hybrid = tmp_path / "hybrid"
    (hybrid / "unified").mkdir(parents=True)
    _cgroup2_tree(hybrid / "unified", "cpu io")  # controllers bound to v1: none for us
    assert cgroups.v2_mount(hybrid) == hybrid / "unified"
    with pytest.raises(cgroups.CgroupError, match="lacks the memory and pids controllers"):
        cgroups.v2_parent(hybrid)


def test_v2_writes_limits_reads_usage_and_kills_through_its_files(tmp_path: Path) -> None:
    parent = _cgroup2_tree(tmp_path, "cpu memory pids")
    path = _execution_dir(parent, "1-0-abc")
    group = cgroups.CgroupV2("1-0-abc", parent, create=False)
    group.set_limits(memory_bytes=128 << 20, pids=32)
    assert (path / "memory.max").read_text() == str(128 << 20)
    assert (path / "memory.swap.max").read_text() == "0"  # RAM only, no swap on top
    assert (path / "memory.oom.group").read_text() == "1"  # an OOM kills the whole run
    assert (path / "pids.max").read_text() == "32"
    group.add(4242)
    assert (path / "cgroup.procs").read_text() == "4242"
    assert group.cpu_ns() == 1_500_000
    assert group.peak_memory() == 123456789
    assert group.oom_kills() == 1
    (path / "cgroup.procs").write_text("")
    assert group.kill() == set()
    assert (path / "cgroup.kill").read_text() == "1"
    (path / "memory.swap.max").unlink()  # swap accounting off: nothing to limit
    (path / "memory.oom.group").unlink()
    (path / "memory.max").write_text("")  # a plain file keeps old bytes; the kernel would not
    group.set_limits(memory_bytes=64 << 20, pids=8)
    assert (path / "memory.max").read_text() == str(64 << 20)
    (path / "memory.max").unlink()
    with pytest.raises(cgroups.CgroupError, match="memory and pids controllers"):
        group.set_limits(memory_bytes=64 << 20, pids=8)


def test_real_cgroup_v2_limits_oom_and_kill() -> None:
    """On a host with v2 memory/pids controllers: a real cgroup, a real OOM kill, cgroup.kill."""
    if os.geteuid() != 0:
        host_skip("needs root to create cgroups")
    try:
        parent = cgroups.v2_parent()
    except (OSError, cgroups.CgroupError) as exc:
        host_skip(f"no usable cgroup v2 memory/pids controllers on this host: {exc}")
    group = cgroups.CgroupV2(f"{os.getpid()}-v2test-{os.urandom(3).hex()}", parent)
    try:
        group.set_limits(memory_bytes=64 << 20, pids=16)
        hog = subprocess.Popen(
            ["python3", "-c", "import sys; sys.stdin.read(1); x = bytearray(512 << 20)"],
            stdin=subprocess.PIPE)
        group.add(hog.pid)
        assert hog.pid in group.procs()
        assert hog.stdin is not None
        hog.stdin.write(b"g")
        hog.stdin.close()
        assert hog.wait(timeout=30) == -9  # OOM-killed: RAM capped, no swap to spill into
        assert group.oom_kills() >= 1 and group.peak_memory() > 32 << 20
        sleeper = subprocess.Popen(["sleep", "600"])
        group.add(sleeper.pid)
        group.kill()
        assert sleeper.wait(timeout=10) == -9 and not group.populated()
    finally:
        group.remove()
    assert not group.dir.exists()
