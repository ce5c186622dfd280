"""A tiny Qwen3-MoE built from a config and saved like an RL checkpoint (no downloads), served
by the OpenAI-compatible server on a free port for each test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from workers.inference import start_server
from workers.rl.model import build_policy
from workers.rl.objectives import build_objective
from workers.rl.spec import ArithmeticSpec, ModelSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe

KEY = "test-key"


def save_tiny_policy(folder: Path, tok: Any, preset: TinyMoeSpec) -> Path:
    """A randomly initialised tiny Qwen3-MoE for ``tok``, saved with it as a checkpoint."""
    model = build_policy(ModelSpec(preset=preset), len(tok), tok.pad_token_id,
                         tok.eos_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = train_bpe(build_objective(ArithmeticSpec()).corpus(), vocab_size=96)
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), tok, TinyMoeSpec(num_layers=2))


@pytest.fixture(scope="module")
def server(model_dir):
    torch.set_num_threads(1)
    with start_server(model_dir, name="tiny", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def policy(server):
    return server.openai_app.policy
