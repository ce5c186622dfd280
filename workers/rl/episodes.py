"""Multi-turn and tool-use groups for the RL loop: episodes played through the rollout backend,
laid out with a separate loss mask so environment and tool tokens never reach the loss.

An objective opts in by exposing `episode_env(example) -> (environment, env task) | None`
(see `workers.envs.adapter.EnvironmentObjective`); None, or an objective without the method,
keeps the single-turn path. Each group's episodes are played by
`workers.envs.rollout.run_episodes` with a `Generate` backed by the step's backend (same
RolloutSpec, weight version and torch generator), scored by the objective's own reward on the
final answers, and padded by `pad_episodes`:
`completion_mask` is the attention mask (every real token, environment replies included) and
`loss_mask` marks the tokens the policy sampled.

Token in, token out: each turn's context goes to the backend as the episode's own token ids
(`RolloutBackend.generate` takes ids as prompts), never as text. Decoding the context and
re-encoding it would re-segment it wherever the policy sampled a non-canonical BPE split or a
merge formed across a turn boundary, and the turn's logprobs would then be sampled under a
context the trainer never re-scores. `episode/retokenized_turns` counts turns whose prompt the
backend did not take verbatim (it hands back the ids it was given, so this is 0 for the `hf` and
`vllm` backends): a guard that must stay 0, not an expected cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from workers.envs.adapter import SEPARATOR, message_text
from workers.rl.objectives import Example, Objective
from workers.rl.rollout import RolloutBackend, RolloutBatch
from workers.rl.spec import RolloutSpec
from workers.rl.triage import TriageCounts, grade

if TYPE_CHECKING:
    from workers.envs.rollout import Episode


@dataclass
class EpisodeBatch(RolloutBatch):
    """A RolloutBatch whose completions hold environment tokens: `completion_mask` is attended
    to, `loss_mask` (B,C) is 1 only on policy-sampled tokens. `norm_len` is the most tokens a
    sequence can sample (for the seq_sum_norm aggregation)."""

    loss_mask: torch.Tensor
    norm_len: int = 1

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def loss_mask(batch: RolloutBatch) -> torch.Tensor:
    """Which completion tokens count in the loss: the sampled ones (all of them, single-turn)."""
    return batch.loss_mask if isinstance(batch, EpisodeBatch) else batch.completion_mask


def norm_len(batch: RolloutBatch, max_new_tokens: int) -> int:
    return max(batch.norm_len, max_new_tokens) if isinstance(batch, EpisodeBatch) \
        else max_new_tokens


class PlainCodec:
    """The RL engine's chat layout, in plain text like the single-turn prompts: every
    non-assistant message is its content and a blank line (tool results tagged with the tool's
    name); an assistant turn is the sampled tokens ending with eos, then a blank line."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.end_of_turn = [int(tokenizer.eos_token_id)]
        self.after_turn = self._enc(SEPARATOR)

    def _enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_message(self, message: dict[str, str]) -> list[int]:
        return self._enc(message_text(message))

    def assistant_prefix(self) -> list[int]:
        return []

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tok.decode(list(token_ids), skip_special_tokens=True)


def transcript_batch(tok: Any, examples: Sequence[Example]) -> EpisodeBatch:
    """Reference episodes (`Example.turns`) laid out as the rollout driver lays out played
    ones, for SFT: each piece encoded on its own, a sampled piece followed by eos; the pieces
    before the first sampled one are the prompt. `loss_mask` is 1 on the sampled pieces (and
    their eos) only. An example without turns is its prompt and reference, as one turn."""
    from workers.envs.rollout import Episode, pad_episodes

    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    episodes = []
    for ex in examples:
        pieces = ex.turns or ((ex.prompt, False), (ex.reference, True))
        if not any(sampled for _, sampled in pieces):
            raise ValueError("a reference episode has no sampled turn to learn")
        ep = Episode(task_id=ex.meta.get("task_id", ""))
        for text, sampled in pieces:
            if sampled and not any(ep.loss_mask):
                ep.prompt_len = len(ep.token_ids)
            ep.extend(enc(text) + ([int(tok.eos_token_id)] if sampled else []), sampled=sampled)
        if not ep.prompt_len:
            raise ValueError("a reference episode starts with a sampled turn: it has no prompt")
        episodes.append(ep)
    t = pad_episodes(episodes, tok.pad_token_id)
    return EpisodeBatch(
        prompt_ids=t["prompt_ids"], prompt_mask=t["prompt_mask"],
        completion_ids=t["completion_ids"], completion_mask=t["completion_attention_mask"],
        logprobs=t["logprobs"], texts=[], loss_mask=t["completion_loss_mask"])


def plays_episodes(objective: Objective) -> bool:
    """Whether some of the objective's examples play as multi-turn or tool-use episodes."""
    return callable(getattr(objective, "episode_env", None)) and \
        getattr(objective, "interaction", "single_turn") != "single_turn"


EPISODE_COUNTS = ("episode/turns", "episode/env_tokens", "episode/sampled_tokens",
                  "episode/retokenized_turns", "episode/max_tokens_stops")


def episodic(objective: Objective, examples: Sequence[Example]) -> list[Any]:
    """Per example, its (environment, env task) when it plays as episodes, else None."""
    source = getattr(objective, "episode_env", None)
    if source is None:
        return [None] * len(examples)
    return [source(e) for e in examples]


class BackendGenerate:
    """`workers.envs.rollout.Generate` over a rollout backend: one turn per call, sampled with
    the run's RolloutSpec and the round's generator from the context's token ids as they are;
    logprobs are the backend's."""

    def __init__(self, backend: RolloutBackend, spec: RolloutSpec,
                 generator: torch.Generator) -> None:
        self.backend, self.spec, self.generator = backend, spec, generator
        self.turns = 0
        self.retokenized = 0

    def __call__(self, token_ids: Sequence[int]) -> tuple[list[int], list[float]]:
        return self.many([token_ids])[0]

    def many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """One turn for each context, sampled as one batch (episodes played in lockstep)."""
        batch = [[int(t) for t in c] for c in contexts]
        out = self.backend.generate(batch, self.spec, self.generator)
        turns = []
        for row, context in enumerate(batch):
            n = int(out.completion_mask[row].sum())
            self.turns += 1
            if out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() != context:
                self.retokenized += 1
            turns.append((out.completion_ids[row, :n].tolist(), out.logprobs[row, :n].tolist()))
        return turns


@dataclass
class PlayedGroups:
    batch: EpisodeBatch
    rewards: list[float]
    components: dict[str, list[float]]
    counts: dict[str, float]
    # per episode: the platform failed it (void play or grading) even after the retries
    infra: list[bool] = field(default_factory=list)


def play_groups(
    objective: Objective, examples: Sequence[Example], sources: Sequence[Any], group: int,
    backend: RolloutBackend, tokenizer: Any, spec: RolloutSpec, generator: torch.Generator,
    pad_id: int, max_tokens: int, retries: int = 0, triage: TriageCounts | None = None,
) -> PlayedGroups:
    """`group` episodes per example (consecutive, like a single-turn batch), scored by the
    objective's reward on each episode's final answer. An episode the platform voided (a tool
    or `respond` raised InfraError) is re-played from the start up to `retries` times, a failed
    grading re-run as often (workers/rl/triage.py); what still failed is flagged in `infra`,
    with reward 0 that must not be trained on."""
    from workers.envs.rollout import pad_episodes, run_episodes

    triage = triage if triage is not None else TriageCounts()
    codec = PlainCodec(tokenizer)
    gen = BackendGenerate(backend, spec, generator)
    plays = [src for src in sources for _ in range(group)]

    def play(src: Any, count: int) -> list[Episode]:
        if isinstance(src, tuple):  # (environment, env task): graded below from the text
            env, env_task = src
            return run_episodes(env, [env_task] * count, gen, codec, max_tokens=max_tokens,
                                score=False)
        return src.play(gen.many, codec, max_tokens, count)  # in lockstep, graded as played

    episodes = [ep for src in sources for ep in play(src, group)]
    triage.failed += sum(ep.infra is not None for ep in episodes)
    for _ in range(retries):
        todo = [i for i, ep in enumerate(episodes) if ep.infra is not None]
        if not todo:
            break
        triage.retried += len(todo)
        for i in todo:
            episodes[i] = play(plays[i], 1)[0]
            triage.recovered += episodes[i].infra is None
    reps = [e for e in examples for _ in range(group)]
    finals = [next(m["content"] for m in reversed(ep.messages) if m["role"] == "assistant")
              for ep in episodes]
    n = len(episodes)
    rewards, infra = [0.0] * n, [True] * n
    components: dict[str, list[float]] = {}
    for i, ep in enumerate(episodes):  # played and graded in the sandbox (terminal tasks)
        if not isinstance(plays[i], tuple) and ep.score is not None and ep.infra is None:
            rewards[i], infra[i] = ep.score.total, False
            for name, value in ep.score.components.items():
                components.setdefault(name, [0.0] * n)[i] = value
    live = [i for i, ep in enumerate(episodes) if ep.infra is None and isinstance(plays[i], tuple)]
    if live:  # a void episode's last answer is not graded: the episode was cut short
        graded = grade(objective.reward, [reps[i] for i in live], [finals[i] for i in live],
                       retries, triage)
        for k, i in enumerate(live):
            rewards[i], infra[i] = graded.rewards[k], graded.infra[k]
            for name, values in graded.components.items():
                components.setdefault(name, [0.0] * n)[i] = values[k]
    t = pad_episodes(episodes, pad_id)
    batch = EpisodeBatch(
        prompt_ids=t["prompt_ids"], prompt_mask=t["prompt_mask"],
        completion_ids=t["completion_ids"], completion_mask=t["completion_attention_mask"],
        logprobs=t["logprobs"], texts=finals, loss_mask=t["completion_loss_mask"],
        norm_len=max(src[0].max_turns if isinstance(src, tuple) else src.max_turns
                     for src in sources) * spec.max_new_tokens,
    )
    attn = int(batch.completion_mask.sum())
    counts = {
        "episode/turns": float(sum(ep.turns for ep in episodes)),
        "episode/env_tokens": float(attn - batch.num_tokens),
        "episode/sampled_tokens": float(batch.num_tokens),
        "episode/retokenized_turns": float(gen.retokenized),
        "episode/max_tokens_stops": float(sum(ep.stop_reason == "max_tokens"
                                              for ep in episodes)),
    }
    return PlayedGroups(batch, rewards, components, counts, infra)
