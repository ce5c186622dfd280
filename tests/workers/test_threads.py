"""Thread allotments: the setting, the default from the cores and the processes sharing them,
applied to torch / OpenMP / MKL in real processes (a fresh interpreter, the inference server's
command line), and reported at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from workers import threads

ROOT = Path(__file__).resolve().parents[2]


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (threads.SETTING, threads.SHARERS, *threads.LIBRARY_VARS)}
    return {**env, "PYTHONPATH": str(ROOT), **values}


def test_the_setting_wins_else_cores_over_the_processes_sharing_them():
    assert threads.allotment(env={threads.SETTING: "3"}, cores=8).threads == 3
    default = threads.allotment(env={threads.SHARERS: "2"}, cores=8)
    assert (default.threads, default.cores, default.sharers) == (4, 8, 2)
    assert "8 usable core(s) / 2 process(es)" in default.describe()
    assert threads.allotment(4, env={threads.SHARERS: "2"}, cores=8).threads == 2  # caller knows
    assert threads.allotment(env={threads.SHARERS: "5"}, cores=2).threads == 1  # at least one
    assert threads.allotment(env={}, cores=6).threads == 6  # a lone process
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match=f"CRUCIBLE_THREADS must be a whole number .*{bad}"):
            threads.allotment(env={threads.SETTING: bad}, cores=2)


def test_sharers_come_from_the_launcher_and_a_configure_can_be_undone(monkeypatch):
    import torch

    assert threads.sharers({}) == 1 and threads.sharers({threads.SHARERS: "3"}) == 3
    with pytest.raises(ValueError, match="at least 1"):
        threads.sharers({threads.SHARERS: "0"})
    monkeypatch.setenv("CRUCIBLE_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = threads.in_use()
    try:
        threads.configure(2)
        assert torch.get_num_threads() == 3 and os.environ["MKL_NUM_THREADS"] == "3"
    finally:
        threads.restore(before)
    assert threads.in_use() == before and "MKL_NUM_THREADS" not in os.environ


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_quota(tmp_path) == 1.5
    assert threads.usable_cores(tmp_path) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cores(tmp_path) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.usable_cores(v1) == 1


@pytest.mark.parametrize("torch_first", [False, True])
def test_configure_sets_torch_openmp_and_mkl_in_a_fresh_process(torch_first):
    code = ("import os\n" + ("import torch\n" if torch_first else "")
            + "from workers import threads\n"
            "a = threads.configure(2)\n"
            "import torch\n"
            "print(a.threads, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'],"
            " os.environ['MKL_NUM_THREADS'])\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    expect = str(max(1, threads.usable_cores() // 2))
    assert out == [expect] * 4
    set_out = subprocess.run([sys.executable, "-c", code], env=_env(CRUCIBLE_THREADS="1"),
                             capture_output=True, text=True, timeout=120, check=True)
    assert set_out.stdout.split() == ["1"] * 4


@pytest.mark.slow
def test_the_inference_server_takes_its_allotment_and_reports_it(tmp_path):
    """`serve` with no setting: the usable cores over the processes sharing them."""
    from workers.rl.model import build_policy
    from workers.rl.objectives import build_objective
    from workers.rl.spec import ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    tok = train_bpe(build_objective().corpus(), vocab_size=96)
    build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=1)), len(tok), tok.pad_token_id,
                 tok.eos_token_id).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    expect = max(1, threads.usable_cores() // 2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.inference", "serve", "--model", str(tmp_path),
         "--port", "0"], env=_env(CRUCIBLE_THREAD_SHARERS="2"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line or proc.poll() is None, "the server exited"
        assert f"threads: {expect} per process" in line, line
        url = line.split(" at ", 1)[1].split(";", 1)[0]
        for _ in range(200):
            try:
                health = httpx.get(url.removesuffix("/v1") + "/health", timeout=5).json()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health["threads"] == expect
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_bad_thread_count_is_refused_by_the_server_command(tmp_path, monkeypatch, capsys):
    from workers.inference.__main__ import main

    monkeypatch.delenv(threads.SETTING, raising=False)  # restored after the test
    assert main(["serve", "--model", str(tmp_path), "--threads", "0"]) == 2
    assert "CRUCIBLE_THREADS must be a whole number of at least 1, not '0'" in \
        capsys.readouterr().err
