"""CRUCIBLE_DEVICE: which device a rank trains on (the CPU tests on a GPU host set it to cpu)."""

from __future__ import annotations

import pytest
import torch

from workers.rl.distributed import DEVICE_ENV, on_cuda


def test_cpu_is_always_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert on_cuda() is False


@pytest.mark.parametrize("value", ["", "auto", " AUTO "])
def test_auto_follows_what_torch_sees(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(DEVICE_ENV, value)
    assert on_cuda() is torch.cuda.is_available()


def test_a_typo_is_an_error_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        on_cuda()


def test_cuda_without_a_gpu_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    if torch.cuda.is_available():
        assert on_cuda() is True
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            on_cuda()
