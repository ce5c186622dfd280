"""The node agent's view of its host, without a web: GPUs from a fake count or from
``nvidia-smi`` (a stand-in script on PATH answering as the real one does), labels from the
environment, and refusals that name the bad variable."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from workers.agent import (
    describe_host,
    detect_gpus,
    heartbeat_interval,
    parse_labels,
    parse_nvidia_smi,
)


def test_fake_gpus_with_a_type_and_without():
    assert detect_gpus({"CRUCIBLE_FAKE_GPUS": "2", "CRUCIBLE_GPU_TYPE": "A100"}) == (2, "A100")
    found = detect_gpus({"CRUCIBLE_FAKE_GPUS": "3"})
    assert (found.total, found.model) == (3, "fake")
    assert detect_gpus({"CRUCIBLE_FAKE_GPUS": "0", "CRUCIBLE_GPU_TYPE": "A100"}).model == ""


@pytest.mark.parametrize("raw", ["two", "-1"])
def test_a_bad_fake_gpu_count_names_the_variable(raw):
    with pytest.raises(SystemExit, match="CRUCIBLE_FAKE_GPUS"):
        detect_gpus({"CRUCIBLE_FAKE_GPUS": raw})


def fake_nvidia_smi(folder: Path, output: str) -> dict[str, str]:
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n[ \"$1\" = \"--query-gpu=name\" ] || exit 9\n"
                      f"printf '{output}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(folder)}


def test_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    env = fake_nvidia_smi(tmp_path, "NVIDIA H200\\nNVIDIA H200\\n")
    monkeypatch.setenv("PATH", env["PATH"])
    assert detect_gpus({}) == (2, "NVIDIA H200")
    assert detect_gpus({"CRUCIBLE_GPU_TYPE": "H200-141GB"}) == (2, "H200-141GB")


def test_no_nvidia_smi_means_no_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus({}) == (0, "")


def test_mixed_gpus_register_as_the_most_common_type():
    assert parse_nvidia_smi("A100\nH100\nH100\n\n") == (3, "H100")
    assert parse_nvidia_smi("") == (0, "")


def test_labels_from_the_environment():
    assert parse_labels("zone=a, ib=true,,gpu.vendor=nvidia , spot") == {
        "zone": "a", "ib": "true", "gpu.vendor": "nvidia", "spot": "true"}
    assert parse_labels("") == {}


def test_describe_host_picks_the_pool_from_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    cpu = describe_host({"CRUCIBLE_NODE_NAME": "box-1"})
    assert (cpu.name, cpu.pool, cpu.gpu_count, cpu.gpu_type) == ("box-1", "cpu", 0, "")
    assert cpu.cpus >= 1 and cpu.memory_mb > 0
    gpu = describe_host({"CRUCIBLE_NODE_NAME": "box-2", "CRUCIBLE_FAKE_GPUS": "2",
                         "CRUCIBLE_NODE_LABELS": "zone=b"})
    assert (gpu.pool, gpu.gpu_count, gpu.labels) == ("gpu", 2, {"zone": "b"})
    sandbox = describe_host({"CRUCIBLE_NODE_NAME": "box-3", "CRUCIBLE_NODE_POOL": "sandbox"})
    assert sandbox.pool == "sandbox"


def test_a_bad_host_description_fails_at_start():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="pool"):
        describe_host({"CRUCIBLE_NODE_NAME": "box", "CRUCIBLE_NODE_POOL": "tpu"})
    with pytest.raises(ValidationError, match="label key"):
        describe_host({"CRUCIBLE_NODE_NAME": "box", "CRUCIBLE_NODE_LABELS": "bad key=1"})


def test_heartbeat_interval():
    assert heartbeat_interval({}) == 10.0
    assert heartbeat_interval({"CRUCIBLE_NODE_HEARTBEAT_S": "0.5"}) == 0.5
    for raw in ("soon", "0"):
        with pytest.raises(SystemExit, match="CRUCIBLE_NODE_HEARTBEAT_S"):
            heartbeat_interval({"CRUCIBLE_NODE_HEARTBEAT_S": raw})


def test_watch_and_probe_intervals_fall_back_on_non_positive_values():
    from workers.agent import probe_interval, watch_interval

    assert (watch_interval({}), probe_interval({})) == (1.0, 300.0)
    assert watch_interval({"CRUCIBLE_NODE_WATCH_S": "0"}) == 1.0
    assert probe_interval({"CRUCIBLE_NODE_PROBE_S": "-5"}) == 300.0
    assert probe_interval({"CRUCIBLE_NODE_PROBE_S": "30"}) == 30.0
    with pytest.raises(SystemExit, match="CRUCIBLE_NODE_WATCH_S must be a number"):
        watch_interval({"CRUCIBLE_NODE_WATCH_S": "often"})
