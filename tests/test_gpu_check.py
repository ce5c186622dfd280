"""scripts/gpu_check.sh: valid bash, and on a machine without CUDA it says it needs a GPU and
exits 0 (the GPU checks themselves run only where `torch.cuda.is_available()`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.skips import host_reason

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason=host_reason("this machine has a GPU; run the script itself"))
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PY": sys.executable,
                               "GPU_CHECK_OUT": str(tmp_path / "out")}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout
