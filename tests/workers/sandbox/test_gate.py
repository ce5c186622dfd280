"""The start-up gate: it waits for the cgroup line as root, then lowers the rlimits and drops to
the sandbox uid with no groups or capabilities before running anything; the shell + setpriv
fallback gives sandboxes the same limits."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.sandbox import Engine, EngineConfig, ExecutionRequest, gate, uids
from workers.sandbox.spec import Limits, Status

PROBE = """
import os, resource, sys
print(os.getresuid(), os.getresgid(), os.getgroups())
for name in ("CPU", "FSIZE", "NOFILE", "CORE"):
    print(name, resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
for line in open("/proc/self/status"):
    if line.startswith(("Cap", "NoNewPrivs")):
        print(line.split()[0], line.split()[1])
print("STDIN", sys.stdin.read())
"""


@pytest.fixture(scope="module")
def binary() -> str:
    if os.geteuid() != 0:
        pytest.skip("the gate is built and run by root")
    path = gate.gate_binary()
    if path is None:
        pytest.skip("no C compiler to build the gate (the engine uses dash + setpriv)")
    return path


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


@pytest.fixture
def sandbox_uid() -> Iterator[int]:
    uid = uids.lease()
    yield uid
    uids.release(uid)


def test_gate_waits_as_root_then_drops_everything(binary: str, sandbox_uid: int) -> None:
    uid = gid = sandbox_uid
    proc = subprocess.Popen(
        [binary, "7", str(3 << 20), "40", str(uid), str(gid), "/usr/bin/python3", "-I", "-S",
         "-c", PROBE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    # Popen returns once the gate is exec'd; it cannot go on before reading its line.
    assert _status(proc.pid)["Uid"].split() == ["0"] * 4
    out, err = proc.communicate(b"go\nthe program's own input\n", timeout=30)
    assert proc.returncode == 0, err
    lines = out.decode().splitlines()
    assert lines[0] == f"({uid}, {uid}, {uid}) ({gid}, {gid}, {gid}) []"
    assert "CPU (7, 7)" in lines
    assert f"FSIZE ({3 << 20}, {3 << 20})" in lines
    assert "NOFILE (40, 40)" in lines
    assert "CORE (0, 0)" in lines
    for cap in ("CapInh:", "CapPrm:", "CapEff:", "CapAmb:"):
        assert f"{cap} 0000000000000000" in lines
    assert "STDIN the program's own input" in lines  # the line was consumed, nothing more


def test_gate_runs_nothing_without_its_line_or_with_bad_arguments(
    binary: str, tmp_path: Path, sandbox_uid: int
) -> None:
    marker = tmp_path / "ran"
    uid = gid = str(sandbox_uid)
    touch = ["/usr/bin/touch", str(marker)]
    cases = [
        ([binary, "1", "1024", "16", uid, gid, *touch], b"no newline"),  # EOF before the line
        ([binary, "1", "1O24", "16", uid, gid, *touch], b"go\n"),
        ([binary, "1", "-1", "16", uid, gid, *touch], b"go\n"),
        ([binary, "1", "1024", "16", "99999999999", gid, *touch], b"go\n"),
        ([binary, "1", "1024", "16", uid, *touch], b"go\n"),  # missing an argument
    ]
    for argv, stdin in cases:
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=30)
        assert done.returncode == 125, (argv, done.stderr)
        assert done.stderr.startswith(b"crucible gate: ")
    assert not marker.exists()


def test_only_root_owned_unwritable_files_are_trusted(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("ownership checks need files owned by root")
    home = tmp_path / "gates"
    home.mkdir(mode=0o755)
    exe = home / "gate-x"
    exe.write_bytes(b"\x7fELF")
    exe.chmod(0o755)
    assert gate.trusted(exe)
    exe.chmod(0o775)
    assert not gate.trusted(exe)  # group-writable
    exe.chmod(0o755)
    link = home / "gate-link"
    link.symlink_to(exe)
    assert not gate.trusted(link)
    home.chmod(0o777)
    assert not gate.trusted(exe)  # anyone could replace it
    home.chmod(0o755)
    os.chown(exe, 65534, 65534)
    assert not gate.trusted(exe)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-gate", "shell-setpriv-gate"])
def test_both_gates_give_sandboxes_their_limits(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the sandbox engine runs as root")
    if compiled and gate.gate_binary() is None:
        pytest.skip("no C compiler to build the gate")
    if not compiled:  # and the Perl status waiter instead of the static one
        monkeypatch.setitem(gate._resolved, "gate", None)
        monkeypatch.setitem(gate._resolved, "waiter", None)
    code = ("import os, resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE),"
            " resource.getrlimit(resource.RLIMIT_FSIZE), os.getgroups())\nprint(input())")
    limits = Limits(open_files=48, file_size_mb=5)
    with Engine(EngineConfig(pool_size=0)) as eng:
        for language, source in (("python", code),
                                 ("bash", "ulimit -Hn; ulimit -Hf; read x; echo $x")):
            result = eng.execute(ExecutionRequest(language=language, code=source,
                                                  stdin="through\n", limits=limits))
            assert result.status == Status.OK, result
            if language == "python":
                # file size in bytes; groups: only the mapped primary group inside the userns
                assert result.stdout.splitlines()[0].startswith(
                    f"(48, 48) ({5 << 20}, {5 << 20})")
            else:
                assert result.stdout.split() == ["48", str((5 << 20) // 1024), "through"]
            assert result.stdout.rstrip().endswith("through")
        # either status waiter tells exit(130) from death by SIGINT (bwrap folds both into 130)
        exited = eng.execute(ExecutionRequest(language="bash", code="exit 130"))
        killed = eng.execute(ExecutionRequest(language="bash", code="kill -SEGV $$"))
    assert (exited.exit_code, exited.signal) == (130, None)
    assert (killed.exit_code, killed.signal) == (None, 11)
