"""Fixtures for RL engine tests: a tokenizer trained on the demo objective and a tiny MoE built
from a config (no downloads)."""

import pytest
import torch

from workers.rl.model import build_policy
from workers.rl.objectives import build_objective
from workers.rl.spec import ArithmeticSpec, ModelSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe


@pytest.fixture(autouse=True)
def _single_thread():
    """The CI machine is small and shared: one intra-op thread per test process."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def objective():
    return build_objective(ArithmeticSpec())


@pytest.fixture(scope="session")
def tokenizer(objective):
    return train_bpe(objective.corpus(), vocab_size=96)


@pytest.fixture
def tiny_model(tokenizer):
    spec = ModelSpec(preset=TinyMoeSpec(num_layers=2))
    return build_policy(spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
