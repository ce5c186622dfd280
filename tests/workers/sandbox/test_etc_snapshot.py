"""The sandbox's /etc: one read-only copy of exactly the entries the toolchains read, equal to
the host's, refreshed when one of them changes on the host."""

from __future__ import annotations

import filecmp
import os
import stat
from pathlib import Path

import pytest

from tests.skips import host_skip
from workers.sandbox import Engine, EngineConfig, ExecutionRequest
from workers.sandbox.policy import bwrap
from workers.sandbox.spec import Status


def _same_tree(host: str, copy: Path) -> bool:
    if os.path.islink(host):
        return copy.is_symlink() and os.readlink(host) == os.readlink(copy)
    if os.path.isdir(host):
        found = sorted(os.listdir(host)) == sorted(os.listdir(copy))
        return found and all(_same_tree(os.path.join(host, n), copy / n) for n in os.listdir(host))
    return filecmp.cmp(host, copy, shallow=False)


def test_snapshot_copies_the_entries_root_owned(engine: Engine) -> None:
    snapshot = bwrap.etc_snapshot()
    assert snapshot is not None
    st = os.lstat(snapshot)
    assert st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    entries = bwrap.etc_binds()
    assert sorted(os.listdir(snapshot)) == sorted({p.split("/")[2] for p in entries})
    for path in entries:
        assert _same_tree(path, snapshot / path.removeprefix("/etc/")), path


def test_sandbox_sees_the_copy_read_only(run: object) -> None:
    code = (
        "import os\nprint(sorted(os.listdir('/etc')))\n"
        "print(open('/etc/ld.so.conf').read() == open('/etc/ld.so.conf').read())\n"
        "for t in ('/etc/ld.so.cache', '/etc/passwd', '/etc/ld.so.conf.d/x.conf'):\n"
        "    try:\n        open(t, 'a').write('x')\n        print('WROTE', t)\n"
        "    except OSError as e:\n        print('denied', e.errno)\n"
    )
    result = run("python", code)  # type: ignore[operator]
    assert result.status == Status.OK, result
    names = sorted({p.split("/")[2] for p in bwrap.etc_binds()})
    assert result.stdout.splitlines()[0] == str(names)
    assert "WROTE" not in result.stdout


def test_a_changed_host_entry_reaches_new_sandboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        host_skip("writes a probe file into the host's /etc")
    probe = Path(f"/etc/crucible-sandbox-probe-{os.urandom(4).hex()}")
    monkeypatch.setattr(bwrap, "_ETC_FILES", (*bwrap._ETC_FILES, str(probe)))
    monkeypatch.setattr(bwrap, "_SNAPSHOT_CHECK_S", 0.0)  # look at the host every time
    monkeypatch.setattr(bwrap, "_snapshot", None)  # afterwards: the copy from before, again
    request = ExecutionRequest(language="python", code=f"print(open('{probe}').read())")
    try:
        with Engine(EngineConfig(pool_size=0)) as eng:
            probe.write_text("first")
            assert eng.execute(request).stdout == "first\n"
            first = bwrap.etc_snapshot()
            tmp = probe.with_name(probe.name + ".new")
            tmp.write_text("second, longer")
            tmp.replace(probe)  # how package tools replace files
            assert eng.execute(request).stdout == "second, longer\n"
            assert bwrap.etc_snapshot() != first
            assert first is not None and first.exists()  # kept: a sandbox may be binding it
    finally:
        probe.unlink(missing_ok=True)
