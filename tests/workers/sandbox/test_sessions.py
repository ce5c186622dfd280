"""Sandbox sessions: lifecycle, snapshot/restore/fork semantics, hostile paths, quotas, idle.

Real sandboxes (bubblewrap, cgroups, overlayfs on a tmpfs): these tests need root, like every
sandbox test, and skip with the host reason where it is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.skips import sandbox_unavailable
from workers.sandbox import sessions as S
from workers.sandbox.spec import EgressPolicy, SessionExec, SessionLimits, SessionStatus
from workers.sandbox.wspath import PathRefused

SERVER = b"""
import socket
srv = socket.socket(socket.AF_UNIX)
srv.bind("/work/sock")
srv.listen()
while True:
    conn, _ = srv.accept()
    conn.sendall(open("/work/a.txt", "rb").read())
    conn.close()
"""
SMALL = SessionLimits(memory_mb=256, disk_mb=32, pids=48, cpu_s=60, wall_s=300, idle_s=300)


@pytest.fixture(scope="module")
def manager() -> Iterator[S.SessionManager]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    with S.SessionManager(watch_every_s=0.05) as mgr:
        yield mgr


@pytest.fixture
def session(manager: S.SessionManager) -> Iterator[S.Session]:
    s = manager.create(SMALL)
    yield s
    s.close()


def test_files_and_processes_live_across_calls(session: S.Session) -> None:
    assert session.exec("echo hello > a.txt && mkdir -p d && echo 2 > d/b").status == "OK"
    r = session.exec("cat a.txt d/b; id -u; pwd")
    assert r.status == SessionStatus.OK and r.stdout == b"hello\n2\n1000\n/work\n"
    assert r.exit_code == 0 and r.wall_ms >= 0
    # a background server started by one call answers the next one (over a unix socket:
    # the seccomp filter allows no other family)
    session.write("serve.py", SERVER)
    bg = session.exec(SessionExec(cmd="python3 serve.py", background=True))
    assert bg.status == "OK" and bg.pid
    r = session.exec("for i in $(seq 50); do python3 -c 'import socket; s = socket.socket("
                     "socket.AF_UNIX); s.connect(\"/work/sock\"); print(s.recv(99).decode())' "
                     "2>/dev/null && break; sleep 0.1; done")
    assert r.stdout == b"hello\n\n"
    assert session.exec("python3 -c 'import socket; socket.socket(socket.AF_INET)'").status \
        == SessionStatus.RE  # no network, not even loopback
    failed = session.exec("exit 3")
    assert failed.status == SessionStatus.RE and failed.exit_code == 3
    assert session.exec("kill -9 $$").signal == 9
    r = session.exec(SessionExec(cmd="cat", stdin="in put"))
    assert r.stdout == b"in put"


WHEEL = b"""
import zipfile
with zipfile.ZipFile("mylib-1.0-py3-none-any.whl", "w") as z:
    z.writestr("mylib/__init__.py", "ANSWER = 42\\n")
    z.writestr("mylib-1.0.dist-info/METADATA",
               "Metadata-Version: 2.1\\nName: mylib\\nVersion: 1.0\\n")
    z.writestr("mylib-1.0.dist-info/WHEEL",
               "Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n")
    z.writestr("mylib-1.0.dist-info/RECORD", "")
"""


def test_packages_installed_into_the_workspace_persist_and_fork(
        manager: S.SessionManager, session: S.Session) -> None:
    session.write("mkwheel.py", WHEEL)
    r = session.exec("python3 mkwheel.py && python3 -m venv --without-pip .venv && "
                     "python3 -m pip install -q --no-index --target pkgs "
                     "mylib-1.0-py3-none-any.whl", timeout=120)
    assert r.status == SessionStatus.OK, r
    check = ("PYTHONPATH=pkgs .venv/bin/python -c "
             "'import mylib, sys; print(mylib.ANSWER, sys.prefix)'")
    assert session.exec(check).stdout == b"42 /work/.venv\n"
    fork = session.fork()
    try:
        assert fork.exec(check).stdout == b"42 /work/.venv\n"
    finally:
        fork.close()


def test_exec_timeout_and_output_cap(session: S.Session) -> None:
    r = session.exec("sleep 30 & sleep 30", timeout=0.5)
    assert r.status == SessionStatus.TLE and r.wall_ms < 5000
    assert session.exec("pgrep -c sleep").stdout.strip() == b"0"  # its process group died
    r = session.exec(SessionExec(cmd="yes", output_bytes=1000))
    assert r.status == SessionStatus.OLE and len(r.stdout) == 1000 and r.stdout_truncated


def test_no_network_and_isolation(session: S.Session) -> None:
    r = session.exec("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)'")
    assert r.status == SessionStatus.RE
    r = session.exec("ls /; cat /etc/shadow; ls /proc/1/fd")
    assert b"shadow" not in r.stdout and b"Permission denied" in r.stderr
    assert session.exec("touch /usr/x").status == SessionStatus.RE
    assert session.exec("kill -9 -1; echo still").status != SessionStatus.LOST
    assert session.exec("echo alive").stdout == b"alive\n"  # the agent is PID 1: it survives


def test_write_read_list(session: S.Session) -> None:
    session.write("src/main.py", b"print('hi')\n")
    session.write("/work/src/data.bin", bytes(range(256)))
    assert session.read("src/main.py") == b"print('hi')\n"
    assert session.read("src/data.bin") == bytes(range(256))
    names = {(e.name, e.kind, e.size) for e in session.list("src")}
    assert names == {("main.py", "file", 12), ("data.bin", "file", 256)}
    assert session.exec("python3 src/main.py").stdout == b"hi\n"
    assert session.exec("stat -c %u src/main.py src").stdout == b"1000\n1000\n"  # sandbox-owned
    with pytest.raises(FileNotFoundError):
        session.read("missing")


@pytest.mark.parametrize("path", [
    "../x", "a/../../x", "/etc/passwd", "/work/../etc/passwd", "/workx/y", "a\x00b", "",
])
def test_hostile_paths_are_refused(session: S.Session, path: str) -> None:
    with pytest.raises(PathRefused):
        session.read(path)
    with pytest.raises(PathRefused):
        session.write(path, b"x")


def test_planted_links_and_fifos_are_never_followed(session: S.Session) -> None:
    session.exec("ln -s /etc link; ln -s /etc/shadow shadow; mkfifo fifo; "
                 "mkdir d; ln -s / d/up")
    for path in ("link/passwd", "shadow", "d/up/etc/passwd", "fifo"):
        with pytest.raises(PathRefused):
            session.read(path)
    with pytest.raises(PathRefused):
        session.write("shadow", b"owned")  # never writes through a link...
    with pytest.raises(PathRefused):
        session.write("link/evil", b"x")
    assert not os.path.exists("/etc/evil")
    kinds = {e.name: e.kind for e in session.list("")}
    assert kinds["link"] == "symlink" and kinds["fifo"] == "other" and kinds["d"] == "dir"
    with pytest.raises(PathRefused):
        session.list("link")


def test_snapshot_restore_rolls_back_files(session: S.Session) -> None:
    session.exec("echo v1 > f; echo keep > k")
    snap = session.snapshot()
    session.exec("echo v2 > f; rm k; echo new > n; sleep 100 &")
    assert session.exec("cat f").stdout == b"v2\n"
    session.restore(snap)
    assert session.exec("cat f k; ls").stdout == b"v1\nkeep\nf\nk\n"
    assert session.exec("pgrep -c sleep").stdout.strip() == b"0"  # processes do not survive
    session.exec("echo v3 > f")  # the session goes on from the restored state
    assert session.exec("cat f").stdout == b"v3\n"
    session.restore(snap)  # and a snapshot can be restored again
    assert session.read("f") == b"v1\n"


def test_second_snapshot_shares_unchanged_files(manager: S.SessionManager,
                                                session: S.Session) -> None:
    session.exec("head -c 2000000 /dev/urandom > big && echo 1 > small")
    first = manager.snapshot(session.snapshot())
    session.exec("echo 2 > small")
    second = manager.snapshot(session.snapshot())
    top1, top2 = (manager.layer_path(snap.layers[0]) for snap in (first, second))
    if S.os.access(S.RSYNC, os.X_OK):  # unchanged files are links to the first layer
        assert (top1 / "big").stat().st_ino == (top2 / "big").stat().st_ino
        assert second.bytes < 100_000 < first.bytes
    assert (top2 / "small").read_bytes() == b"2\n" and (top1 / "small").read_bytes() == b"1\n"
    session.restore(first.id)
    assert session.read("small") == b"1\n"
    session.restore(second.id)
    assert session.read("small") == b"2\n" and len(session.read("big")) == 2_000_000


def test_fork_is_isolated_from_parent_and_siblings(manager: S.SessionManager,
                                                   session: S.Session) -> None:
    session.exec("mkdir -p pkg && echo base > pkg/a && head -c 1000000 /dev/zero > blob")
    snap = session.snapshot()
    forks = [manager.fork(snap, SMALL) for _ in range(3)]
    try:
        for i, f in enumerate(forks):
            assert f.uid != session.uid
            assert f.exec("cat pkg/a").stdout == b"base\n"
            assert f.exec(f"echo {i} >> pkg/a && rm blob && echo mine > own{i}").status == "OK"
        session.exec("echo parent >> pkg/a")
        assert session.read("pkg/a") == b"base\nparent\n"
        assert session.exec("ls").stdout == b"blob\npkg\n"
        for i, f in enumerate(forks):
            assert f.read("pkg/a") == f"base\n{i}\n".encode()
            assert f.exec("ls").stdout == f"own{i}\npkg\n".encode()
        # a fork of a fork stacks layers
        grand = forks[0].fork()
        try:
            assert grand.read("pkg/a") == b"base\n0\n" and grand.read("own0") == b"mine\n"
        finally:
            grand.close()
    finally:
        for f in forks:
            f.close()
    assert session.exec("cat pkg/a").stdout == b"base\nparent\n"


def test_fork_many_makes_a_group_with_overlapped_start_ups(manager: S.SessionManager,
                                                          session: S.Session) -> None:
    session.exec("echo base > a && head -c 1000000 /dev/zero > blob")
    snap = session.snapshot()
    # one lent folder per fork, as the agent proxy binds an episode's socket (somewhere the
    # sandbox uid can reach: bubblewrap binds after dropping privileges)
    top = Path(tempfile.mkdtemp(prefix="crucible-lent-"))
    top.chmod(0o755)
    lent = []
    for i in range(8):
        folder = top / f"lent{i}"
        folder.mkdir()
        (folder / "who").write_text(f"episode {i}\n")
        folder.chmod(0o755)
        (folder / "who").chmod(0o644)
        lent.append(str(folder))
    group = manager.fork_many(snap, 8, SMALL, binds=lambda i: ((lent[i], "/crucible/lent"),))
    try:
        assert len({f.uid for f in group} | {session.uid}) == 9
        assert all(f.id in manager.sessions for f in group)
        for i, f in enumerate(group):
            r = f.exec(f"cat a /crucible/lent/who && echo {i} >> a && id -u")
            assert r.stdout == f"base\nepisode {i}\n1000\n".encode(), r
        for i, f in enumerate(group):
            assert f.read("a") == f"base\n{i}\n".encode()
        assert session.read("a") == b"base\n"
    finally:
        for f in group:
            f.close()
    with pytest.raises(ValueError, match="1 to 256"):
        manager.fork_many(snap, 0, SMALL)
    with pytest.raises(S.UnknownSnapshot):
        manager.fork_many("nope", 2, SMALL)
    # all or nothing: a bad bind for the third fork closes the two already started
    before = set(manager.sessions)
    with pytest.raises(ValueError, match="under /crucible/"):
        manager.fork_many(snap, 4, SMALL, binds=lambda i: ((lent[i], "/work/x" if i == 2
                                                             else "/crucible/lent"),))
    assert set(manager.sessions) == before
    manager.drop_snapshot(snap)
    shutil.rmtree(top)


def test_pre_started_sandboxes_take_a_workspace_when_forked() -> None:
    """keep_warm: forks mount their workspace (and lent folders, and the egress proxy) into
    sandboxes started ahead; they behave as any fork, and the pool refills."""
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    top = Path(tempfile.mkdtemp(prefix="crucible-lent-"))
    (top / "who").write_text("lent\n")
    top.chmod(0o755)
    (top / "who").chmod(0o644)
    with S.SessionManager(watch_every_s=0.05) as mgr:
        session = mgr.create(SMALL)
        session.exec("echo base > a && mkdir -p d && echo deep > d/b")
        snap = session.snapshot()
        mgr.keep_warm(SMALL, 3)
        assert mgr.wait_warm()
        key = mgr._warm_key(SMALL, False)
        blanks = list(mgr._warm[key])
        assert blanks[0].exec("ls -A /work /crucible").stdout == b"/crucible:\n\n/work:\n"
        group = mgr.fork_many(snap, 5, SMALL, binds=((str(top), "/crucible/lent"),))
        try:
            assert group[:3] == blanks  # the three started ahead, then two cold ones
            for i, f in enumerate(group):
                r = f.exec(f"cat a d/b /crucible/lent/who && echo {i} >> a && touch d/new{i}")
                assert r.stdout == b"base\ndeep\nlent\n", r
                assert f.exec("echo x > /crucible/lent/w").status == SessionStatus.RE
            assert [f.read("a") for f in group] == [f"base\n{i}\n".encode() for i in range(5)]
            assert session.read("a") == b"base\n"
            # a restore in an adopted sandbox works as in any other
            group[0].restore(snap)
            assert group[0].read("a") == b"base\n"
            assert mgr.wait_warm()  # refilled in the background
            assert len(mgr._warm[key]) == 3 and not set(mgr._warm[key]) & set(group)
        finally:
            for f in group:
                f.close()
        # the pool's network must match: a policy fork takes no plain pre-started sandbox
        policy = EgressPolicy(allow=["pypi.org"])
        f = mgr.fork(snap, SMALL, egress=policy)
        try:
            assert f not in blanks and f.exec("echo $http_proxy").stdout == \
                b"http://127.0.0.1:3128\n"
        finally:
            f.close()
        mgr.keep_warm(SMALL, 0)
        assert mgr._warm[key] == []
    shutil.rmtree(top)
    with pytest.raises(ValueError, match="may not nest"):
        S._check_binds(((str(top.parent), "/crucible/a"), (str(top.parent), "/crucible/a/b")))


def test_snapshots_are_dropped_with_their_layers(manager: S.SessionManager,
                                                 session: S.Session) -> None:
    session.exec("echo x > f")
    snap = session.snapshot()
    layer = manager.snapshot(snap).layers[0]
    assert manager.layer_path(layer).is_dir()
    fork = manager.fork(snap, SMALL)
    manager.drop_snapshot(snap)
    assert manager.layer_path(layer).is_dir()  # the fork still uses it
    fork.close()
    assert not manager.layer_path(layer).exists()
    with pytest.raises(S.UnknownSnapshot):
        manager.fork(snap)


def test_fork_bomb_is_stopped_and_others_unaffected(manager: S.SessionManager,
                                                    session: S.Session) -> None:
    other = manager.create(SMALL)
    try:
        r = session.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=10)
        assert r.status == SessionStatus.PIDS, r
        assert "process quota" in r.message
        assert session.exec("echo ok").stdout == b"ok\n"
        assert other.exec("echo fine").status == SessionStatus.OK
    finally:
        other.close()


def test_disk_filler_is_stopped(manager: S.SessionManager, session: S.Session) -> None:
    other = manager.create(SMALL)
    try:
        r = session.exec("dd if=/dev/zero of=fill bs=1M count=100")
        assert r.status == SessionStatus.DISK, r
        assert "disk quota" in r.message
        with pytest.raises(PathRefused, match="full"):
            session.write("more", b"x" * (1 << 20))
        session.exec("rm fill")
        assert session.exec("echo room > f && cat f").stdout == b"room\n"
        assert other.exec("head -c 10000000 /dev/zero > g && echo ok").stdout == b"ok\n"
    finally:
        other.close()


def test_memory_hog_is_stopped(manager: S.SessionManager, session: S.Session) -> None:
    r = session.exec("python3 -c 'x = bytearray(1 << 30); print(len(x))'")
    assert r.status == SessionStatus.MLE, r
    assert "memory quota" in r.message
    assert session.exec("echo ok").stdout == b"ok\n"


def test_cpu_quota_closes_the_session(manager: S.SessionManager) -> None:
    s = manager.create(SMALL.model_copy(update={"cpu_s": 1}))
    r = s.exec("while :; do :; done", timeout=20)
    assert r.status == SessionStatus.CPU, r
    assert s.closed_reason and "cpu quota" in s.closed_reason
    with pytest.raises(S.SessionClosed):
        s.exec("echo")


def test_idle_timeout_and_lifetime(manager: S.SessionManager) -> None:
    idle = manager.create(SMALL.model_copy(update={"idle_s": 1}))
    life = manager.create(SMALL.model_copy(update={"wall_s": 2}))
    try:
        idle.exec("echo")
        deadline = time.monotonic() + 10
        while idle.closed_reason is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert idle.closed_reason is not None and "idle" in idle.closed_reason
        with pytest.raises(S.SessionClosed):
            idle.read("x")
        with pytest.raises(S.SessionClosed, match="idle"):
            manager.get(idle.id)  # the manager still says why
        r = life.exec("sleep 20", timeout=30)  # the lifetime ends it mid-call
        assert r.status == SessionStatus.LOST and "expired" in r.message
    finally:
        idle.close()
        life.close()


def test_close_cleans_up(manager: S.SessionManager) -> None:
    s = manager.create(SMALL)
    s.exec("sleep 100 &")
    root, group = s.root, s.cgroup
    s.close()
    assert not root.exists()
    assert group is not None
    dirs = getattr(group, "dirs", {"v2": getattr(group, "dir", None)})
    assert all(not p.exists() for p in dirs.values())
    with pytest.raises(S.SessionClosed):
        s.exec("echo")
    with pytest.raises(S.SessionClosed):
        manager.get(s.id)


def test_orphans_of_a_dead_host_are_swept(manager: S.SessionManager) -> None:
    dead = 2**22 + 17  # above pid_max's default: no live process has it
    assert not os.path.exists(f"/proc/{dead}")
    orphan = S.BASE / "s" / f"{dead}-abc"
    (orphan / "scratch").mkdir(parents=True)
    S._mount("crucible-session", orphan / "scratch", "tmpfs", "size=1m")
    layer = manager.layers_dir / f"{dead}-feed"
    layer.mkdir()
    live = manager.create(SMALL)
    try:
        S.sweep_orphans()
        assert not orphan.exists() and not layer.exists()
        assert str(orphan) not in S.Path("/proc/mounts").read_text()
        assert live.dir.exists() and live.exec("echo ok").stdout == b"ok\n"  # ours stay
    finally:
        live.close()


def test_a_host_with_over_1024_open_descriptors_still_talks_to_its_agents(
        manager: S.SessionManager) -> None:
    """A long-lived host (the web, a test run) holds many descriptors; select() refuses one
    numbered 1024 or more, so the agent's pipe is polled instead (found by the PG test pass)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"host: RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:  # fill every low number: new pipes land above 1024
            held.append(os.open(os.devnull, os.O_RDONLY))
        s = manager.create(SMALL)
        try:
            assert s.exec("echo high").stdout == b"high\n"
        finally:
            s.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
