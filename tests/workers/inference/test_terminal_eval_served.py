"""Terminal tasks evaluated through the real policy server: `run_eval` serves a checkpoint for
the evaluation and plays each episode with its OpenAI tool calls in sandbox sessions.

A random model writes no tool call, so the tiny checkpoint is rigged: its tokenizer gets one
extra token whose text is a whole `shell` call block, and its weights make that token the
argmax after any input (every layer's output projection zeroed, so the last hidden state is
the last token's embedding, whose first coordinate is set to 1; the final norm keeps only that
coordinate; the output head maps it to the call token alone). The server's own rendering of
tools and tool messages, sampling, Hermes parsing and `tool_calls` assembly then run for real,
turn after turn. The checkpoint records the raw episode prompt format, as an RL-trained terminal
checkpoint does, so the server renders each turn in the layout the trainer plays."""

from __future__ import annotations

import string
from typing import Any

import pytest
import torch

from tests.skips import sandbox_unavailable
from tests.workers.envs.test_terminal import LIMITS
from tests.workers.inference.conftest import save_tiny_policy
from workers.envs.adapter import SEPARATOR, message_text, render_opening
from workers.envs.terminal.episode import SYSTEM_PROMPT
from workers.envs.terminal.play import opening
from workers.envs.terminal.task import parse_task
from workers.envs.terminal.tools import TOOL_SCHEMAS
from workers.envs.toolcalls import call_text, tools_prompt
from workers.inference.engine import raw_tool_chat
from workers.rl import prompt_format
from workers.rl.objectives import build_objective
from workers.rl.spec import ArithmeticSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe

CALL = call_text("shell", {"command": "echo 42 > answer.txt"})


def task(task_id: str, answer: str) -> dict[str, Any]:
    test = ("from pathlib import Path\n\n\ndef test_answer():\n"
            f"    assert Path('/work/answer.txt').read_text().strip() == '{answer}'\n")
    return {"id": task_id, "instruction": f"Write {answer} to answer.txt.", "split": "eval",
            "hidden_tests": {"test_answer.py": test}, "limits": LIMITS, "max_turns": 2}


@pytest.fixture(scope="module")
def rigged_dir(tmp_path_factory):
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    torch.set_num_threads(1)
    corpus = [*build_objective(ArithmeticSpec()).corpus(), string.printable,
              tools_prompt(TOOL_SCHEMAS)]
    tok = train_bpe(corpus, vocab_size=256)
    tok.add_tokens([CALL])
    folder = save_tiny_policy(tmp_path_factory.mktemp("rigged"), tok,
                              TinyMoeSpec(num_layers=1, max_position_embeddings=8192))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    call_id = tok.convert_tokens_to_ids(CALL)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[call_id, 0] = 10.0
    model.save_pretrained(folder)
    prompt_format.write(folder, prompt_format.PromptFormat(format="raw", layout="episode"))
    return folder


def test_a_raw_episode_checkpoint_is_shown_the_layout_it_trained_in() -> None:
    """What the server renders for an eval turn equals what the RL engine's terminal play
    builds (`opening`, the sampled call and eos, `[shell result]` and the tool's text)."""
    t = parse_task(task("forty-two", "42"))
    calls = [{"id": "call_1", "type": "function", "function": {
        "name": "shell", "arguments": '{"command": "echo 42 > answer.txt"}'}}]
    # what TerminalEpisode sends an endpoint: the tools go as `tools`, not in the text
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": t.instruction},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "status: OK"}]
    played = (render_opening(opening(t)) + CALL + "<eos>" + SEPARATOR
              + message_text({"role": "tool", "name": "shell", "content": "status: OK"}))
    assert raw_tool_chat(messages, list(TOOL_SCHEMAS), "episode", "<eos>") == played
    assert "[shell result]\nstatus: OK" in played and "<tool_response>" not in played


def test_run_eval_serves_a_checkpoint_that_plays_terminal_tasks(rigged_dir) -> None:
    from workers.inference.eval import run_eval

    spec = {"source": "terminal", "tasks": [task("forty-two", "42"), task("other", "43")]}
    report = run_eval(spec, {"policy": {"kind": "checkpoint", "uri": rigged_dir.as_uri()},
                             "sampling": {"max_tokens": 1}, "concurrency": 2},
                      include_samples=True)
    rows = {r["task_id"]: r for r in report["tasks"]}
    assert report["summary"]["errors"] == 0, report["tasks"]
    assert rows["forty-two"]["mean_reward"] == 1.0 and rows["other"]["mean_reward"] == 0.0
    assert report["summary"]["pass_at"] == {"1": 0.5}
    # two turns each (the task's max_turns), each one call: the second turn's request held
    # the first's assistant tool_calls and tool result, which the server rendered
    assert rows["forty-two"]["turns"] == 2.0 == rows["other"]["turns"]
    assert rows["forty-two"]["completion_tokens"] == 2.0  # one sampled token a turn
    assert all(s["stop_reason"] == "max_turns" for s in report["samples"])
    assert report["policy"]["checkpoint"] == rigged_dir.as_uri()
