import subprocess

import pytest  # noqa: F401 - Terminal-Bench tests often import it unused


def test_total_is_printed():
    out = subprocess.run(["python3", "/app/src/total.py"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "100"


def test_data_unchanged():
    with open("/app/data.csv") as f:
        assert f.read() == "name,amount\nalpha,10\nbeta,32\ngamma,58\n"
