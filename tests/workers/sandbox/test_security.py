"""The attacks a model-written program might try; each test asserts the attack failed.

Network targets: a listener on the host's 127.0.0.1 (it must see zero connections) and 192.0.2.1
(TEST-NET-1, never routed): inside the sandbox both must fail at once, sending nothing anywhere.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from workers.sandbox import Engine, EngineConfig, ExecutionRequest, uids, workdir
from workers.sandbox.scoring import assert_request, humaneval_request, score
from workers.sandbox.spec import ExecutionResult, Limits, Status

Run = Callable[..., ExecutionResult]


def _processes_matching(marker: str) -> list[int]:
    """Live (non-zombie) host processes whose command line contains marker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _gone(marker: str, within: float = 5.0) -> bool:
    """Killed processes may take a moment to leave /proc; a survivor would stay for minutes."""
    end = time.monotonic() + within
    while _processes_matching(marker):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_fork_bomb_is_contained(run: Run) -> None:
    result = run("bash", ":(){ :|:& };:\nsleep 30 # crucible-forkbomb\n",
                 limits=Limits(pids=32, wall_ms=2000))
    assert result.status in (Status.TLE, Status.RE)
    assert _gone("crucible-forkbomb") and _gone("main.sh")
    assert run("python", "print('alive')").stdout == "alive\n"


def test_python_fork_bomb_is_contained(run: Run) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n" \
           "    except OSError:\n        pass\n"
    result = run("python", code, limits=Limits(pids=16, wall_ms=1500, cpu_ms=3000))
    assert result.status == Status.TLE


def test_one_gigabyte_allocation_is_mle(run: Run) -> None:
    result = run("python", "x = bytearray(1 << 30)\nprint('allocated')\n",
                 limits=Limits(memory_mb=128))
    assert result.status == Status.MLE
    assert "allocated" not in result.stdout
    c = run("c", "#include <stdio.h>\n#include <stdlib.h>\nint main(void){ size_t n = 1UL << 30;"
                 " volatile char *p = malloc(n); if (!p) return 3;"
                 " for (size_t i = 0; i < n; i += 4096) p[i] = 1;"
                 " printf(\"%d\\n\", p[n - 4096]); return 0; }\n",
            limits=Limits(memory_mb=128))
    assert c.status in (Status.MLE, Status.RE)
    assert c.status != Status.RE or c.exit_code == 3  # refused outright, never allocated


def test_connect_to_a_host_loopback_listener_fails(run: Run) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e.errno)\n"
        )
        result = run("python", code)
        c = run("c", "#include <sys/socket.h>\n#include <netinet/in.h>\n#include <arpa/inet.h>\n"
                     "#include <stdio.h>\nint main(void){ int s = socket(AF_INET, SOCK_STREAM, 0);"
                     " if (s < 0) { perror(\"socket\"); return 0; }"
                     " struct sockaddr_in a = {0}; a.sin_family = AF_INET;"
                     f" a.sin_port = htons({port}); a.sin_addr.s_addr = inet_addr(\"127.0.0.1\");"
                     " if (connect(s, (void*)&a, sizeof a) == 0) puts(\"CONNECTED\");"
                     " return 0; }\n")
        with pytest.raises(BlockingIOError):
            listener.accept()  # zero connections reached the listener
    finally:
        listener.close()
    assert "refused" in result.stdout and "CONNECTED" not in result.stdout
    assert "CONNECTED" not in c.stdout


def test_connect_to_an_external_address_fails_at_once(run: Run) -> None:
    code = (
        "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
        "    print('CONNECTED')\nexcept OSError as e:\n    print('failed', e.errno)\n"
    )
    result = run("python", code)
    assert result.status == Status.OK
    assert result.stdout == "failed 97\n"  # refused by policy at once, not a connect timeout


def test_vsock_and_other_socket_families_are_denied(run: Run) -> None:
    code = (
        "import socket\n"
        "for fam in (socket.AF_VSOCK, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):\n"
        "    try:\n        socket.socket(fam, socket.SOCK_STREAM if fam != socket.AF_NETLINK"
        " else socket.SOCK_RAW)\n        print('OPENED', fam)\n"
        "    except OSError as e:\n        print('denied', e.errno)\n"
        "a, b = socket.socketpair()\nprint('unix ok')\n"
    )
    result = run("python", code)
    assert "OPENED" not in result.stdout
    assert result.stdout.count("denied 97") == 4  # EAFNOSUPPORT
    assert "unix ok" in result.stdout


def test_writes_outside_the_work_directory_fail(run: Run, tmp_path: Path) -> None:
    host_dir = Path(__file__).resolve().parent
    targets = ["/usr/crucible-probe", "/etc/crucible-probe", "/crucible-probe",
               "/root/crucible-probe", f"{host_dir}/crucible-probe", "/var/crucible-probe",
               "/home/crucible-probe", "/usr/bin/python3"]
    code = (
        f"targets = {targets!r}\n"
        "for t in targets:\n    try:\n        open(t, 'a').write('x')\n        print('WROTE', t)\n"
        "    except OSError as e:\n        print('denied', t, e.errno)\n"
        "open('/work/ok', 'w').write('fine')\nopen('/tmp/ok', 'w').write('fine')\nprint('done')\n"
    )
    result = run("python", code)
    assert "WROTE" not in result.stdout and "done" in result.stdout
    for target in targets[:-1]:
        assert not Path(target).exists()


def test_planted_symlink_is_not_followed_by_the_host(run: Run) -> None:
    code = "import os\nos.symlink('/etc/shadow', 'result.txt')\nos.mkfifo('fifo')\n" \
           "open('real.txt', 'w').write('data')\n"
    result = run("python", code, read_back=["result.txt", "fifo", "real.txt"])
    assert result.status == Status.OK
    assert result.files == {"real.txt": "data"}
    assert set(result.file_errors) == {"result.txt", "fifo"}
    shadow_head = Path("/etc/shadow").read_text()[:10] if Path("/etc/shadow").exists() else "root:"
    assert shadow_head not in str(result.files)


def test_infinite_cpu_loop_is_tle(run: Run) -> None:
    result = run("python", "while True:\n    pass\n", limits=Limits(cpu_ms=500, wall_ms=5000))
    assert result.status == Status.TLE
    c = run("c", "int main(void){ volatile unsigned long i = 0; for(;;) i++; }\n",
            limits=Limits(cpu_ms=500, wall_ms=5000))
    assert c.status == Status.TLE


def test_sleep_forever_is_tle(run: Run) -> None:
    result = run("python", "import time\ntime.sleep(10**6)\n", limits=Limits(wall_ms=700))
    assert result.status == Status.TLE
    assert "wall time" in result.message


def test_stdout_flood_is_ole_and_capped(run: Run) -> None:
    result = run("python", "while True:\n    print('y' * 4096)\n",
                 limits=Limits(output_bytes=64 << 10))
    assert result.status == Status.OLE and result.stdout_truncated
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 64 << 10
    flood = run("bash", "yes flood", limits=Limits(output_bytes=32 << 10))
    assert flood.status == Status.OLE


def test_double_forked_daemon_does_not_outlive_the_run(run: Run) -> None:
    marker = "31337.4242"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
        "time.sleep(0.3)\nprint('parent done')\n"
    )
    result = run("python", code)
    assert result.status == Status.OK
    assert _gone(marker)
    bash = run("bash", f"(setsid sleep {marker}1 &) ; echo started")
    assert bash.stdout == "started\n"
    assert _gone(f"{marker}1")


def test_no_host_environment_or_processes_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "crucible-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("CRUCIBLE_TEST_SECRET", secret)
    code = (
        "import os\nprint(dict(os.environ))\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "print('PIDS', len(pids))\n"
        "for p in pids:\n    for f in ('environ', 'cmdline'):\n        try:\n"
        "            print(open(f'/proc/{p}/{f}', 'rb').read())\n        except OSError:\n"
        "            pass\n"
    )
    with Engine(EngineConfig(pool_size=0)) as eng:  # a sandbox started after the secret was set
        result = eng.execute(ExecutionRequest(language="python", code=code))
    assert result.status == Status.OK
    assert secret not in result.stdout and "CRUCIBLE_TEST_SECRET" not in result.stdout
    assert int(result.stdout.split("PIDS ")[1].split()[0]) <= 3  # its own PID namespace


def test_each_concurrent_sandbox_runs_as_its_own_unprivileged_host_uid(engine: Engine) -> None:
    """Per-user kernel limits (inotify, message queues, RLIMIT_NPROC) are per host uid: two
    sandboxes running at once must not share one, and none may be root."""
    markers = ("27182.818", "31415.926")
    box: dict[str, ExecutionResult] = {}
    limits = Limits(wall_ms=3000)
    workers = [threading.Thread(target=lambda m=m: box.update({m: engine.execute(
        ExecutionRequest(language="bash", code=f"exec sleep {m}", limits=limits))}))
        for m in markers]
    for worker in workers:
        worker.start()
    seen: dict[str, set[str]] = {m: set() for m in markers}
    try:
        end = time.monotonic() + 10
        while not all(seen.values()) and time.monotonic() < end:
            for marker in markers:
                for pid in _processes_matching(marker):
                    with contextlib.suppress(OSError):
                        status = Path(f"/proc/{pid}/status").read_text()
                        seen[marker].update(line.split()[1] for line in status.splitlines()
                                            if line.startswith("Uid:"))
            time.sleep(0.02)
    finally:
        for worker in workers:
            worker.join()
    pool = uids.pool()
    first, second = (seen[m] for m in markers)
    assert len(first) == len(second) == 1 and first != second
    for uid in (*first, *second):  # real uid on the host: not 0 (bwrap keeps root's)
        assert pool.first <= int(uid) < pool.first + pool.count
    assert all(box[m].status == Status.TLE for m in markers)


def test_hundred_megabyte_file_is_refused(run: Run) -> None:
    code = (
        "written = 0\ntry:\n    with open('big', 'wb') as f:\n        for _ in range(100):\n"
        "            f.write(b'0' * (1 << 20))\n            written += 1 << 20\n"
        "except OSError as e:\n    print('refused', e.errno)\nprint('written', written)\n"
    )
    result = run("python", code, limits=Limits(file_size_mb=16))
    assert "refused 27" in result.stdout  # EFBIG
    assert int(result.stdout.split("written ")[1]) <= 16 << 20
    bash = run("bash", "exec head -c 100M /dev/zero > big", limits=Limits(file_size_mb=16))
    assert bash.status == Status.RE and bash.signal == 25  # SIGXFSZ
    assert "file size exceeded" in bash.message


def test_filling_tmpfs_stops_at_its_size(run: Run) -> None:
    code = (
        "written = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n"
        "            f.write(b'0' * (1 << 20))\n            f.flush()\n"
        "            written += 1 << 20\n"
        "except OSError as e:\n    print('full', e.errno)\nprint('written', written)\n"
    )
    result = run("python", code, limits=Limits(tmpfs_mb=8, file_size_mb=512, memory_mb=256))
    assert "full 28" in result.stdout  # ENOSPC
    assert int(result.stdout.split("written ")[1]) <= 8 << 20


def test_filling_the_work_directory_stops_at_its_cap_not_the_host_disk(run: Run) -> None:
    """Each file is under the file-size limit; together they would fill the disk without the
    work directory's own tmpfs cap. Then an inode flood of empty files."""
    code = (
        "import os\nst = os.statvfs('/work')\nprint('size', st.f_blocks * st.f_frsize)\n"
        "n = 0\ntry:\n    for n in range(200):\n        with open(f'f{n}', 'wb') as f:\n"
        "            f.write(b'0' * (1 << 20))\n"
        "except OSError as e:\n    print('full', e.errno, n)\n"
        "for i in range(200):\n    os.remove(f'f{i}') if os.path.exists(f'f{i}') else None\n"
        "try:\n    for m in range(100000):\n        open(f'e{m}', 'w').close()\n"
        "except OSError as e:\n    print('inodes', e.errno, m)\n"
    )
    result = run("python", code, limits=Limits(workdir_mb=8, file_size_mb=4, wall_ms=30_000,
                                               cpu_ms=20_000))
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert int(lines["size"]) <= (8 << 20) + (1 << 20)  # the cap, plus main.py's pages
    errno_, files = lines["full"].split()
    assert errno_ == "28" and int(files) <= 8  # ENOSPC after about 8 MB, not 200
    errno_, inodes = lines["inodes"].split()
    assert errno_ == "28" and int(inodes) <= workdir.INODES
    # (The host disk's free space is not compared: other processes on a shared machine move it
    # by more than this test writes. ENOSPC at the cap says where the bytes went.)
    assert run("python", "print('alive')").stdout == "alive\n"


def test_a_forged_exit_status_does_not_end_the_run(run: Run) -> None:
    """The status waiter's fd and tag are in PID 1's /proc entries: writing a fake `EXIT 0`
    there, then printing the answer and hanging, must still be a TLE."""
    code = (
        "mapfile -d '' args < /proc/1/cmdline\n"
        'echo "${args[4]} EXIT 0" > /proc/1/fd/${args[3]} && echo forged\n'
        "echo 42\nsleep 30\n"
    )
    result = run("bash", code, limits=Limits(wall_ms=1500))
    assert result.status == Status.TLE
    assert result.stdout.endswith("42\n")


def test_nested_user_namespace_is_denied(run: Run) -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('clone', os.system('unshare -U true 2>/dev/null') != 0)\n"
    )
    result = run("python", code)
    assert "unshare -1 1" in result.stdout  # EPERM
    assert "clone True" in result.stdout
    bash = run("bash", "unshare --user --map-root-user id && echo ESCAPED")
    assert "ESCAPED" not in bash.stdout


def test_dangerous_syscalls_are_denied(run: Run) -> None:
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "calls = {'keyctl': 250, 'io_uring_setup': 425, 'ptrace': 101, 'mount': 165,"
        " 'setns': 308, 'bpf': 321, 'perf_event_open': 298}\n"
        "for name, nr in calls.items():\n    ctypes.set_errno(0)\n"
        "    r = libc.syscall(nr, 0, 0, 0, 0, 0)\n    print(name, r, ctypes.get_errno())\n"
    )
    result = run("python", code)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert len(lines) == 7
    for name, outcome in lines.items():
        assert outcome == "-1 1", (name, outcome)  # EPERM from the seccomp filter


def test_early_exit_before_tests_scores_zero(engine: Engine) -> None:
    tests = "assert solve() == 42\n"
    honest = engine.execute(assert_request("python", "def solve():\n    return 42\n", tests))
    assert score(honest) == 1.0
    for cheat in (
        "import sys\ndef solve():\n    return 0\nsys.exit(0)\n",
        "import os\ndef solve():\n    return 0\nprint('PASSED')\nos._exit(0)\n",
        "def solve():\n    return 0\nprint('ok 1 passed')\nraise SystemExit\n",
    ):
        result = engine.execute(assert_request("python", cheat, tests))
        assert result.tests_passed is False and score(result) == 0.0, cheat
    forged = engine.execute(assert_request(
        "python", "import os\nos.write(4, b'PASS\\n')\nfor fd in range(3, 20):\n    try:\n"
        "        os.write(fd, b'0000 PASS \\n')\n    except OSError:\n        pass\n"
        "raise SystemExit(0)\n", tests))
    assert score(forged) == 0.0
    he = engine.execute(humaneval_request("def f():\n", "    import sys; sys.exit(0)\n",
                                          "def check(c):\n    assert c() == 1\n", "f"))
    assert score(he) == 0.0


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    for tid in os.listdir(f"/proc/{me}/task"):
        with contextlib.suppress(OSError):
            for pid in Path(f"/proc/{me}/task/{tid}/children").read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                        found.append(int(pid))
    return found


def _empty_cgroups_of_this_process() -> list[Path]:
    from workers.sandbox import cgroups

    parent = (cgroups.ROOT / "pids" / cgroups.GROUP if cgroups.backend() is cgroups.CgroupV1
              else cgroups.v2_parent())
    return [p for p in parent.glob(f"{os.getpid()}-*")
            if not (p / "cgroup.procs").read_text().split()]


def test_killed_sandboxes_leave_no_zombies_or_cgroups() -> None:
    import ctypes

    requests = [
        ExecutionRequest(language="python", code="import time\ntime.sleep(60)\n",
                         limits=Limits(wall_ms=300)),
        ExecutionRequest(language="bash", code=":(){ :|:& };:\nsleep 60\n",
                         limits=Limits(wall_ms=500, pids=16)),
        ExecutionRequest(language="python", code="import os\nif os.fork() == 0:\n    os.setsid()\n"
                         "    os.execv('/bin/sleep', ['sleep', '60'])\nprint(1)\n"),
        ExecutionRequest(language="python", code="print(1)"),
    ] * 3
    # Zombies already here are not the sandbox's: once an engine has made this process a
    # subreaper, other tests' orphans (chromium's crashpad handler, in the browser tests that
    # share the process) are re-parented to it. Only zombies that appear now are counted.
    before = set(_zombie_children())
    with Engine(EngineConfig(pool_size=1, warm_languages=("python",))) as eng:
        results = eng.execute_batch(requests, concurrency=3)
    assert [results[0].status, results[2].status, results[3].status] == [Status.TLE, Status.OK,
                                                                         Status.OK]
    assert results[1].status in (Status.TLE, Status.RE)
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(0)
    assert libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 1  # subreaper
    end = time.monotonic() + 10
    def new_zombies() -> list[int]:
        return [pid for pid in _zombie_children() if pid not in before]

    while (new_zombies() or _empty_cgroups_of_this_process()) and time.monotonic() < end:
        time.sleep(0.05)  # teardown runs on a background thread
    from workers.sandbox import process as sandbox_process

    assert [(pid, Path(f"/proc/{pid}/stat").read_text()[:40], pid in sandbox_process._tracked)
            for pid in new_zombies()] == []
    assert _empty_cgroups_of_this_process() == []  # every finished execution's cgroup is gone
