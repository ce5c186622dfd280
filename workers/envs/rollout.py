"""Multi-turn and tool-use rollouts at the token level, with the loss mask the trainer needs.

The driver alternates: the policy generates a turn from the whole conversation so far (token ids
in, token ids and their logprobs out); the environment replies (test output, tool results) and
its reply is tokenized and appended. The result is one token sequence with a loss mask that is 1
on tokens the policy sampled and 0 on everything else: the prompt, template scaffold, and every
environment or tool token, which the policy did not choose and must not be trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from workers.envs.base import Environment, EnvTask, InfraError, Message, Score


class Generate(Protocol):
    def __call__(self, token_ids: Sequence[int]) -> tuple[list[int], list[float]]:
        """Sample one assistant turn after `token_ids`: (new token ids, their logprobs)."""
        ...


class GenerateMany(Protocol):
    def __call__(self, contexts: Sequence[Sequence[int]]
                 ) -> list[tuple[list[int], list[float]]]:
        """Sample one assistant turn after each context, in one batch."""
        ...


class ChatCodec(Protocol):
    """How messages become tokens. `encode_message` renders a whole non-assistant message with
    its scaffold; an assistant turn is `assistant_prefix` + sampled tokens (ending with
    `end_of_turn` when the model stopped by itself) + `after_turn`."""

    end_of_turn: list[int]
    after_turn: list[int]

    def encode_message(self, message: Message) -> list[int]: ...
    def assistant_prefix(self) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


class ChatMLCodec:
    """ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`, as Qwen uses) over any tokenizer
    with `encode(text) -> ids` and `decode(ids) -> text`."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tok = tokenizer
        self.end_of_turn = tokenizer.encode("<|im_end|>")
        self.after_turn = tokenizer.encode("\n")

    def encode_message(self, message: Message) -> list[int]:
        return self.tok.encode(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")

    def assistant_prefix(self) -> list[int]:
        return self.tok.encode("<|im_start|>assistant\n")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tok.decode(list(token_ids))


StopReason = Literal["done", "max_turns", "max_tokens", "infra"]


@dataclass
class Episode:
    """One conversation as the trainer sees it: `token_ids`, `loss_mask` (1 = policy-sampled)
    and `logprobs` (the sampler's, 0.0 where the mask is 0) are parallel lists."""

    task_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    stop_reason: StopReason = "done"
    score: Score | None = None
    infra: str | None = None  # why the platform ended it (stop_reason "infra"): void, not 0

    def extend(self, ids: Sequence[int], *, sampled: bool,
               logprobs: Sequence[float] | None = None) -> None:
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)


def open_episode(task_id: str, messages: list[Message], codec: ChatCodec) -> Episode:
    """An episode whose prompt is `messages`, encoded one message at a time."""
    ep = Episode(task_id=task_id, messages=messages)
    for message in ep.messages:
        ep.extend(codec.encode_message(message), sampled=False)
    ep.prompt_len = len(ep.token_ids)
    return ep


def sample_turn(ep: Episode, generate: Generate, codec: ChatCodec) -> str:
    """One assistant turn sampled from the episode's own ids and appended to it (sampled ids
    with mask 1, a truncated turn closed, the scaffold after it); returns the turn's text."""
    ep.extend(codec.assistant_prefix(), sampled=False)
    ids, logprobs = generate(ep.token_ids)
    return end_turn(ep, ids, logprobs, codec)


def end_turn(ep: Episode, ids: Sequence[int], logprobs: Sequence[float],
             codec: ChatCodec) -> str:
    """Append a sampled turn (after its `assistant_prefix`) and close it; its text."""
    end = list(codec.end_of_turn)
    ids, logprobs = list(ids), list(logprobs)
    ep.extend(ids, sampled=True, logprobs=logprobs)
    stopped = bool(end) and ids[-len(end):] == end
    text = codec.decode(ids[: len(ids) - len(end)] if stopped else ids)
    if not stopped:
        ep.extend(end, sampled=False)  # close a truncated turn so the template stays valid
    ep.extend(codec.after_turn, sampled=False)
    ep.turns += 1
    return text


def _play(env: Environment, task: EnvTask, generate: Generate, codec: ChatCodec,
          max_tokens: int) -> Episode:
    ep = open_episode(task.id, env.initial_messages(task), codec)
    while True:
        text = sample_turn(ep, generate, codec)
        ep.messages.append({"role": "assistant", "content": text})
        if len(ep.token_ids) >= max_tokens:
            ep.stop_reason = "max_tokens"
            return ep
        if ep.turns >= env.max_turns:  # no reply needed: the last turn is the final answer
            ep.stop_reason = "max_turns"
            return ep
        try:
            reply = env.respond(task, ep.messages)
        except InfraError as exc:  # a broken sandbox or lost session: the episode is void
            ep.stop_reason, ep.infra = "infra", str(exc) or type(exc).__name__
            return ep
        if reply.done:
            ep.stop_reason = "done"
            return ep
        encoded = [codec.encode_message(m) for m in reply.messages]
        if len(ep.token_ids) + sum(map(len, encoded)) + len(codec.assistant_prefix()) \
                >= max_tokens:
            ep.stop_reason = "max_tokens"
            return ep
        for message, ids in zip(reply.messages, encoded, strict=True):
            ep.messages.append(message)
            ep.extend(ids, sampled=False)


def run_episodes(
    env: Environment, tasks: Sequence[EnvTask], generate: Generate, codec: ChatCodec, *,
    max_tokens: int = 4096, score: bool = True,
) -> list[Episode]:
    """Play each task to the end, then score the final answers in one batch."""
    episodes = [_play(env, task, generate, codec, max_tokens) for task in tasks]
    if score and episodes:
        live = [i for i, e in enumerate(episodes) if e.infra is None]
        scores = env.score_conversations([tasks[i] for i in live],
                                         [episodes[i].messages for i in live]) if live else []
        for i, s in zip(live, scores, strict=True):
            episodes[i].score = s
        for e in episodes:  # a void episode is not graded: its score says so
            if e.infra is not None:
                e.score = Score(0.0, {}, infra=e.infra)
    return episodes


def run_episode(
    env: Environment, task: EnvTask, generate: Generate, codec: ChatCodec, *,
    max_tokens: int = 4096, score: bool = True,
) -> Episode:
    return run_episodes(env, [task], generate, codec, max_tokens=max_tokens, score=score)[0]


def pad_episodes(episodes: Sequence[Episode], pad_id: int) -> dict[str, Any]:
    """Episodes as tensors in the RL engine's rollout layout: left-padded prompt (B,P), then the
    rest of the conversation right-padded (B,C). Unlike a single-turn batch, the completion
    needs two masks: `completion_attention_mask` (1 on every real token, environment replies
    included: the policy must attend to them when re-scoring) and `completion_loss_mask` (1 only
    on tokens the policy sampled)."""
    import torch

    if not episodes:
        raise ValueError("no episodes to pad")
    p = max(e.prompt_len for e in episodes)
    c = max(len(e.token_ids) - e.prompt_len for e in episodes)
    b = len(episodes)
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p), dtype=torch.long)
    comp_ids = torch.full((b, c), pad_id, dtype=torch.long)
    attn = torch.zeros((b, c), dtype=torch.long)
    loss = torch.zeros((b, c), dtype=torch.long)
    logprobs = torch.zeros((b, c), dtype=torch.float32)
    for i, e in enumerate(episodes):
        head, tail = e.token_ids[: e.prompt_len], e.token_ids[e.prompt_len:]
        if head:
            prompt_ids[i, p - len(head):] = torch.tensor(head)
            prompt_mask[i, p - len(head):] = 1
        if tail:
            comp_ids[i, : len(tail)] = torch.tensor(tail)
            attn[i, : len(tail)] = 1
            loss[i, : len(tail)] = torch.tensor(e.loss_mask[e.prompt_len:])
            logprobs[i, : len(tail)] = torch.tensor(e.logprobs[e.prompt_len:])
    rewards = torch.tensor([e.score.total if e.score else 0.0 for e in episodes])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
            "completion_attention_mask": attn, "completion_loss_mask": loss,
            "logprobs": logprobs, "rewards": rewards}
