"""Token-in multi-turn rollouts: across a 10-turn episode the backend samples from the episode's
own token ids (never decoded and re-encoded), so the tensors the trainer consumes hold exactly
the sampled tokens, with their sampler logprobs, and environment tokens are masked out."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from workers.envs.adapter import as_objective
from workers.envs.base import Component, Environment, EnvTask, Message, Reply, Rubric
from workers.rl.episodes import PlainCodec, play_groups
from workers.rl.forward import forward_completion
from workers.rl.losses import token_logprobs
from workers.rl.model import build_policy
from workers.rl.rollout import HFRollout, Prompt, RolloutBatch
from workers.rl.spec import ModelSpec, RolloutSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe
from workers.rl.vllm_rollout import prompt_layout

TURNS = 10
REPLIES = [("ab ba" if k % 2 else "ba ab") for k in range(TURNS)]


class FixedReplies(Environment):
    """Never done: after turn k the user says REPLIES[k-1], until max_turns ends it."""

    def respond(self, task: EnvTask, conversation: Sequence[Message]) -> Reply:
        turns = sum(m["role"] == "assistant" for m in conversation)
        return Reply([{"role": "user", "content": REPLIES[turns - 1]}], done=False)


def exact(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
    return [(float(c.strip() == t.answer), {}) for t, c in zip(tasks, completions, strict=True)]


class Recording:
    """The real HF backend, with each call's prompt and sampled turn written down."""

    def __init__(self, inner: HFRollout) -> None:
        self.inner = inner
        self.calls: list[tuple[Prompt, list[int], list[float]]] = []

    def generate(self, prompts: Sequence[Prompt], spec: RolloutSpec,
                 generator: torch.Generator) -> RolloutBatch:
        out = self.inner.generate(prompts, spec, generator)
        n = int(out.completion_mask[0].sum())
        self.calls.append((prompts[0], out.completion_ids[0, :n].tolist(),
                           out.logprobs[0, :n].tolist()))
        return out

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.inner.sync_weights(model)


@pytest.fixture(scope="module")
def ab_tokenizer() -> Any:
    """A BPE over a three-letter alphabet: merges cover almost every pair of letters, so a
    policy sampling its tokens freely writes splits that re-encode differently ('a' 'b' comes
    back as 'ab'): decode -> encode is not the identity on sampled text."""
    rng = random.Random(0)
    corpus = ["".join(rng.choice("ab ") for _ in range(200)) + "\n\n" for _ in range(50)]
    return train_bpe(corpus, 40)


def test_ten_turns_train_on_exactly_the_sampled_tokens(ab_tokenizer):
    torch.manual_seed(0)
    tok = ab_tokenizer
    env = FixedReplies(tasks=[EnvTask(id="t", prompt="aab bba", answer="ab")],
                       rubric=Rubric((Component("exact", 1.0, exact, "exact"),)),
                       mode="multi_turn", max_turns=TURNS)
    objective = as_objective(env)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=2)), len(tok),
                         tok.pad_token_id, tok.eos_token_id)
    backend = Recording(HFRollout(model, tok))
    spec = RolloutSpec(group_size=2, max_new_tokens=8, temperature=1.0)
    g = torch.Generator()
    g.manual_seed(1)
    played = play_groups(objective, objective.train, [objective.episode_env(objective.train[0])],
                         2, backend, tok, spec, g, tok.pad_token_id, 4096)
    batch = played.batch
    assert played.counts["episode/turns"] == 2 * TURNS
    assert played.counts["episode/retokenized_turns"] == 0
    assert len(backend.calls) == 2 * TURNS
    assert all(not isinstance(prompt, str) for prompt, _, _ in backend.calls)  # token ids in

    codec = PlainCodec(tok)
    eos = tok.eos_token_id
    opening = [i for m in env.initial_messages(env.tasks[0]) for i in codec.encode_message(m)]
    resegmented = 0
    # The trainer re-scores prompt + completion with its own forward.
    logits, _, _ = forward_completion(model, batch, slice(None), True, torch.device("cpu"))
    rescored = token_logprobs(logits, batch.completion_ids)  # (B,C)
    for row in range(2):
        calls = backend.calls[row * TURNS:(row + 1) * TURNS]
        # What the episode must look like, built from the sampled turns and the fixed replies.
        expect_ids: list[int] = []
        expect_loss: list[int] = []
        expect_lp: list[float] = []
        for k, (prompt, sampled, lps) in enumerate(calls):
            # Each turn sampled from exactly the tokens the trainer sees before it.
            assert list(prompt) == opening + expect_ids
            text = tok.decode(list(prompt), skip_special_tokens=False)
            resegmented += tok(text, add_special_tokens=False)["input_ids"] != list(prompt)
            assert 0 < len(sampled) <= spec.max_new_tokens and len(lps) == len(sampled)
            closing = [] if sampled[-1] == eos else [eos]  # a truncated turn is closed
            env_ids = list(codec.after_turn)
            if k < TURNS - 1:
                env_ids += codec.encode_message({"role": "user", "content": REPLIES[k]})
            expect_ids += sampled + closing + env_ids
            expect_loss += [1] * len(sampled) + [0] * (len(closing) + len(env_ids))
            expect_lp += lps + [0.0] * (len(closing) + len(env_ids))
        assert batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist() == opening
        attn = batch.completion_mask[row].bool()
        assert batch.completion_ids[row][attn].tolist() == expect_ids
        assert batch.loss_mask[row][attn].tolist() == expect_loss
        assert batch.loss_mask[row][~attn].sum() == 0
        assert batch.logprobs[row][attn].tolist() == pytest.approx(expect_lp, abs=0.0)
        lm = batch.loss_mask[row].bool()
        sampled_all = [t for _, s, _ in calls for t in s]
        assert batch.completion_ids[row][lm].tolist() == sampled_all
        # The sampler's logprobs are the trainer's own log-probabilities of the same tokens in
        # the same context (float rounding apart): no turn was sampled under another context.
        assert torch.allclose(batch.logprobs[row][lm], rescored[row][lm], atol=1e-4, rtol=0)
    # The text path would have re-segmented these contexts (what the test guards against).
    assert resegmented >= 2


def test_prompt_layout_keeps_token_ids_and_tokenizes_text(ab_tokenizer):
    """The vLLM backend's prompt layout: token-id prompts are sent and laid out as given, even
    a non-canonical split that the tokenizer would never produce from text."""
    tok = ab_tokenizer
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    assert tok("ab", add_special_tokens=False)["input_ids"] != [a, b]  # non-canonical
    ids, mask = prompt_layout(tok, [[a, b], "ab ba"])
    text = tok("ab ba", add_special_tokens=False)["input_ids"]
    width = max(2, len(text))
    assert ids.shape == mask.shape == (2, width)
    assert ids[0][mask[0].bool()].tolist() == [a, b]
    assert ids[1][mask[1].bool()].tolist() == text
    assert mask[0].tolist() == [0] * (width - 2) + [1, 1]  # left padding
    assert ids[0][~mask[0].bool()].eq(tok.pad_token_id).all()
    same, same_mask = prompt_layout(tok, ["ab ba", "ab"])  # text only: the tokenizer's batch
    enc = tok(["ab ba", "ab"], return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(same, enc["input_ids"]) and torch.equal(same_mask, enc["attention_mask"])
