"""Token-level multi-turn rollouts: environment and tool tokens are masked out of the loss."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from workers.envs import load_environment
from workers.envs.base import Message
from workers.envs.rollout import ChatMLCodec, run_episode

SYSTEM, USER, ASSISTANT, TOOL, END = 1, 2, 3, 4, 5
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


class CharCodec:
    """One token per character (its code point); roles and end-of-turn are ids 1..5."""

    end_of_turn = [END]
    after_turn: list[int] = []

    def encode_message(self, message: Message) -> list[int]:
        return [ROLES[message["role"]], *map(ord, message["content"]), END]

    def assistant_prefix(self) -> list[int]:
        return [ASSISTANT]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in token_ids if i > END)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
TOOL_ENV = {"source": "tasks",
            "tasks": [{"id": "t", "prompt": "What is 6*7?", "answer": "42"}],
            "rubric": {"components": [{"name": "correct", "checker": "math_equiv"}]},
            "interaction": {"mode": "tool_use", "max_turns": 3, "tools": ["calculator"]}}


class Scripted:
    """Plays fixed turns; records the context it was given each time."""

    def __init__(self, turns: list[list[int]], logprob: float = -0.5) -> None:
        self.turns = list(turns)
        self.logprob = logprob
        self.contexts: list[list[int]] = []

    def __call__(self, token_ids: Sequence[int]) -> tuple[list[int], list[float]]:
        self.contexts.append(list(token_ids))
        ids = self.turns.pop(0)
        return ids, [self.logprob] * len(ids)


def test_tool_episode_matches_the_hand_built_sequence_and_mask() -> None:
    env = load_environment(TOOL_ENV)
    task = env.task("t")
    system = env.initial_messages(task)[0]["content"]
    policy = Scripted([chars(CALL) + [END], chars("42") + [END]])
    ep = run_episode(env, task, policy, CharCodec())

    prompt = [SYSTEM, *chars(system), END, USER, *chars("What is 6*7?"), END]
    turn1 = chars(CALL) + [END]
    tool = [TOOL, *chars("42"), END]
    turn2 = chars("42") + [END]
    expected = prompt + [ASSISTANT] + turn1 + tool + [ASSISTANT] + turn2
    mask = [0] * len(prompt) + [0] + [1] * len(turn1) + [0] * len(tool) + [0] + [1] * len(turn2)
    assert ep.token_ids == expected
    assert ep.loss_mask == mask
    assert ep.logprobs == [-0.5 if m else 0.0 for m in mask]
    assert ep.prompt_len == len(prompt)
    assert ep.turns == 2 and ep.stop_reason == "done"
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool",
                                                "assistant"]
    assert ep.messages[3] == {"role": "tool", "name": "calculator", "content": "42"}
    # The policy saw the whole conversation so far, tool result included, each time.
    assert policy.contexts[1] == expected[: len(expected) - len(turn2)]
    assert ep.score is not None and ep.score.total == 1.0 and ep.score.info["turns"] == 2


def test_truncated_turn_is_closed_by_a_masked_end_token_and_turns_run_out() -> None:
    env = load_environment(TOOL_ENV)
    task = env.task("t")
    calls = [chars(CALL)] * 3  # never ends a turn by itself, always calls the tool
    ep = run_episode(env, task, Scripted(calls), CharCodec())
    assert ep.turns == 3 and ep.stop_reason == "max_turns"
    assert ep.sampled_tokens == 3 * len(CALL)
    ends = [i for i, t in enumerate(ep.token_ids) if t == END and i >= ep.prompt_len]
    assert all(ep.loss_mask[i] == 0 for i in ends)  # closing tokens the model never sampled
    assert ep.score is not None and ep.score.total == 0.0


def test_token_budget_stops_the_episode() -> None:
    env = load_environment(TOOL_ENV)
    task = env.task("t")
    codec = CharCodec()
    prompt_len = sum(len(codec.encode_message(m)) for m in env.initial_messages(task))
    ep = run_episode(env, task, Scripted([chars(CALL) + [END]] * 3), codec,
                     max_tokens=prompt_len + len(CALL) + 5)
    assert ep.stop_reason == "max_tokens" and ep.turns == 1


def test_malformed_tool_calls_get_an_error_reply() -> None:
    env = load_environment(TOOL_ENV)
    task = env.task("t")
    bad = "<tool_call>{not json}</tool_call>"
    ep = run_episode(env, task, Scripted([chars(bad) + [END], chars("42") + [END]]),
                     CharCodec())
    assert ep.messages[3]["role"] == "tool" and "not valid JSON" in ep.messages[3]["content"]
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    ep = run_episode(env, task, Scripted([chars(unknown) + [END], chars("42") + [END]]),
                     CharCodec())
    assert "unknown tool 'rm'" in ep.messages[3]["content"]


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode(errors="replace")


def test_chatml_codec_renders_qwen_style_turns() -> None:
    codec = ChatMLCodec(ByteTokenizer())
    assert bytes(codec.encode_message({"role": "user", "content": "hi"})) == \
        b"<|im_start|>user\nhi<|im_end|>\n"
    env = load_environment(TOOL_ENV)
    reply = ByteTokenizer().encode("42<|im_end|>")
    ep = run_episode(env, env.task("t"), Scripted([reply]), codec)
    text = bytes(ep.token_ids).decode()
    assert text.endswith("<|im_start|>assistant\n42<|im_end|>\n")
    assert ep.messages[-1]["content"] == "42" and ep.score.total == 1.0  # type: ignore[union-attr]
    assert ep.sampled_tokens == len(reply)


@pytest.mark.parametrize("expression,expected", [("6*7", "42"), ("1/3+1/6", "1/2 (≈0.5)"),
                                                 ("2**-2", "1/4 (≈0.25)")])
def test_calculator_is_exact(expression: str, expected: str) -> None:
    env = load_environment(TOOL_ENV)
    assert env.call_tool("calculator", {"expression": expression})["content"] == expected


@pytest.mark.parametrize("expression", ["__import__('os')", "2**100000", "1/0", "x+1"])
def test_calculator_refuses_anything_else(expression: str) -> None:
    env = load_environment(TOOL_ENV)
    assert env.call_tool("calculator", {"expression": expression})["content"].startswith("error")


def test_padded_batch_keeps_environment_tokens_attended_but_out_of_the_loss() -> None:
    torch = pytest.importorskip("torch")
    from workers.envs.rollout import pad_episodes

    env = load_environment(TOOL_ENV)
    task = env.task("t")
    two_turns = run_episode(env, task, Scripted([chars(CALL) + [END], chars("42") + [END]]),
                            CharCodec())
    one_turn = run_episode(env, task, Scripted([chars("7") + [END]]), CharCodec())
    batch = pad_episodes([two_turns, one_turn], pad_id=0)
    tail = two_turns.token_ids[two_turns.prompt_len:]
    b, c = batch["completion_ids"].shape
    assert (b, c) == (2, len(tail))
    assert batch["completion_ids"][0].tolist() == tail
    assert batch["completion_loss_mask"][0].tolist() == two_turns.loss_mask[two_turns.prompt_len:]
    assert batch["completion_attention_mask"][0].tolist() == [1] * len(tail)
    short = len(one_turn.token_ids) - one_turn.prompt_len  # [ASSISTANT, "7", END]
    assert batch["completion_attention_mask"][1].tolist() == [1] * short + [0] * (c - short)
    assert batch["completion_loss_mask"][1].tolist() == [0, 1, 1] + [0] * (c - short)
    assert batch["prompt_mask"].sum().item() == two_turns.prompt_len + one_turn.prompt_len
    assert batch["logprobs"][0][batch["completion_loss_mask"][0].bool()].eq(-0.5).all()
    assert batch["rewards"].tolist() == [1.0, 0.0]
    assert batch["logprobs"].dtype == torch.float32
