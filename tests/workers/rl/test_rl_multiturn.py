"""Multi-turn and tool-use episodes in the RL loop: environment tokens are attended to in the
forward pass but never reach the loss (zero gradient, no effect on any loss term)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from workers.envs import as_objective, load_environment
from workers.envs.rollout import Episode, pad_episodes
from workers.rl.actor import merge, split_groups
from workers.rl.episodes import EpisodeBatch, PlainCodec, loss_mask
from workers.rl.rollout import RolloutBatch
from workers.rl.sinks import JsonlSink, NullSink, read_jsonl
from workers.rl.spec import parse_spec
from workers.rl.tokenizer import train_bpe
from workers.rl.trainer import Trainer


class LocalEngine:
    """The three calls `Trainer.update` makes on a DeepSpeed engine, on a plain module: backward
    accumulates gradients, step leaves them for the test to read. Keeps the completion logits
    of each forward so their gradient can be inspected."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        self.logits: list[torch.Tensor] = []

    def __call__(self, **kwargs):
        out = self.module(**kwargs)
        out.logits.retain_grad()
        self.logits.append(out.logits)
        return out

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def get_global_grad_norm(self) -> None:
        return None


def two_turn_episode(prompt: list[int], turn1: list[int], env: list[int], turn2: list[int],
                     lp: float) -> Episode:
    """prompt | turn1 (sampled) | environment reply | turn2 (sampled), by hand."""
    ep = Episode(task_id="t")
    ep.extend(prompt, sampled=False)
    ep.prompt_len = len(prompt)
    ep.extend(turn1, sampled=True, logprobs=[lp] * len(turn1))
    ep.extend(env, sampled=False)
    ep.extend(turn2, sampled=True, logprobs=[lp - 0.3] * len(turn2))
    return ep


def batch_of(episodes: Sequence[Episode], pad_id: int) -> EpisodeBatch:
    t = pad_episodes(episodes, pad_id)
    return EpisodeBatch(t["prompt_ids"], t["prompt_mask"], t["completion_ids"],
                        t["completion_attention_mask"], t["logprobs"], [""] * len(episodes),
                        loss_mask=t["completion_loss_mask"], norm_len=16)


def run_update(run: Trainer, model: torch.nn.Module, batch: EpisodeBatch,
               ref_logp: torch.Tensor) -> tuple[dict[str, float], LocalEngine]:
    model.zero_grad()
    engine = LocalEngine(model)
    advs = torch.tensor([1.0, -1.0])
    stats, skipped = run.update(engine, batch, advs, torch.tensor([1.0, 0.0]), ref_logp, 2,
                                False, 0)
    assert not skipped
    return stats, engine


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_environment_tokens_get_zero_gradient_and_leave_every_loss_term_unchanged(
        tmp_path, tokenizer, tiny_model, agg):
    spec = parse_spec({"algorithm": {"kl_coef": 0.1, "entropy_coef": 0.01, "dpo_coef": 0.1,
                                     "loss_agg": agg},
                       "rollout": {"group_size": 2},
                       "checkpoint": {"dir": str(tmp_path)}, "output": {"stdout": False}})
    run = Trainer(spec, NullSink(), None, 0, 1)
    pad = tokenizer.pad_token_id
    env = [3, 4, 5, 6, 7]  # the arithmetic tokenizer has 16 ids
    episodes = [two_turn_episode([8, 9, 10], [11, 12, 13], env, [14, 15], -1.0),
                two_turn_episode([9, 8], [12, 11], env[:3], [15, 14, 13], -2.0)]
    batch = batch_of(episodes, pad)
    n1 = 3
    env_cols = [list(range(n1, n1 + 5)), list(range(2, 5))]
    policy_cols = [[0, 1, 2, 8, 9], [0, 1, 5, 6, 7]]
    for row, cols in enumerate(env_cols):
        assert batch.completion_mask[row, cols].tolist() == [1] * len(cols)
        assert batch.loss_mask[row, cols].tolist() == [0] * len(cols)
    assert batch.num_tokens == 10  # sampled tokens only
    ref = torch.full(batch.completion_ids.shape, -1.5)

    base, engine = run_update(run, tiny_model, batch, ref)
    grads = {k: p.grad.clone() for k, p in tiny_model.named_parameters() if p.grad is not None}
    # The completion logits (position t predicts completion token t) get gradient on sampled
    # tokens only: an environment token is never a target.
    p = batch.prompt_ids.shape[1]
    g = engine.logits[0].grad[:, p - 1:-1].abs().sum(-1)  # (b,C)
    for row in range(2):
        assert all(float(g[row, c]) == 0.0 for c in env_cols[row])
        assert all(float(g[row, c]) > 0.0 for c in policy_cols[row])

    # Sampler and reference logprobs at environment positions are arbitrary: nothing changes.
    noisy = EpisodeBatch(**{**batch.__dict__, "logprobs": batch.logprobs.clone()})
    noisy_ref = ref.clone()
    for row, cols in enumerate(env_cols):
        noisy.logprobs[row, cols] = -7.0
        noisy_ref[row, cols] = -0.01
    same, _ = run_update(run, tiny_model, noisy, noisy_ref)
    assert same == base
    for k, p_ in tiny_model.named_parameters():
        if k in grads:
            assert torch.equal(p_.grad, grads[k]), k
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "kept_frac",
                "dpo_loss"):
        assert key in base, key
    # ... while the same change on a sampled token moves the loss.
    moved = EpisodeBatch(**{**batch.__dict__, "logprobs": batch.logprobs.clone()})
    moved.logprobs[0, policy_cols[0][-1]] = -7.0
    other, _ = run_update(run, tiny_model, moved, ref)
    assert other["pg_loss"] != base["pg_loss"]


def test_merge_and_split_keep_the_loss_mask(tokenizer):
    pad = tokenizer.pad_token_id
    ep = batch_of([two_turn_episode([5, 6], [10], [3, 4], [11], -1.0)] * 2, pad)
    single = RolloutBatch(torch.tensor([[5, 6, 7]] * 2), torch.ones(2, 3, dtype=torch.long),
                          torch.tensor([[9, 9, 9, 9, 9, 9]] * 2),
                          torch.ones(2, 6, dtype=torch.long), torch.zeros(2, 6), ["", ""])
    both = merge([ep, single], pad)
    assert isinstance(both, EpisodeBatch)
    assert loss_mask(both)[:2].tolist() == [[1, 0, 0, 1, 0, 0]] * 2
    assert loss_mask(both)[2:].tolist() == [[1] * 6] * 2  # single-turn: every sampled token
    parts = split_groups(both, 2)
    assert all(isinstance(p, EpisodeBatch) for p in parts)
    assert parts[0].loss_mask.tolist() == [[1, 0, 0, 1, 0, 0]] * 2
    assert parts[1].loss_mask.tolist() == [[1] * 6] * 2
    plain = merge([single, single], pad)
    assert not isinstance(plain, EpisodeBatch) and loss_mask(plain) is plain.completion_mask


def test_plain_codec_layout_matches_the_examples_prompt():
    env = load_environment({"source": "tasks",
                            "tasks": [{"id": "t", "prompt": "What is 6*7?", "answer": "42"}],
                            "rubric": {"components": [{"name": "c", "checker": "math_equiv"}]},
                            "interaction": {"mode": "tool_use", "max_turns": 2,
                                            "tools": ["calculator"]}})
    objective = as_objective(env)
    assert objective.interaction == "tool_use"
    assert objective.episode_env(objective.train[0])[1].id == "t"
    tokenizer = train_bpe(objective.corpus(), 200)
    codec = PlainCodec(tokenizer)
    opening = [i for m in env.initial_messages(env.task("t")) for i in codec.encode_message(m)]
    assert codec.decode(opening) == objective.train[0].prompt
    assert codec.end_of_turn == [tokenizer.eos_token_id]
    single = as_objective(load_environment({"source": "builtin", "name": "arithmetic"}))
    assert single.interaction == "single_turn" and single.episode_env(single.train[0]) is None


def _sandbox():
    from tests.workers.envs.conftest import sandbox_unavailable, shared_sandbox

    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    return shared_sandbox()


def test_zero3_on_several_ranks_is_refused_for_episodic_objectives(tmp_path):
    env = load_environment({"source": "tasks",
                            "tasks": [{"id": "t", "prompt": "6*7?", "answer": "42"}],
                            "rubric": {"components": [{"name": "c", "checker": "math_equiv"}]},
                            "interaction": {"mode": "tool_use", "max_turns": 2,
                                            "tools": ["calculator"]}})
    spec = parse_spec({"trainer": {"zero_stage": 3, "prompts_per_step": 2},
                       "checkpoint": {"dir": str(tmp_path)}, "output": {"stdout": False}})
    with pytest.raises(ValueError, match="zero_stage = 3 on 2 ranks"):
        Trainer(spec, NullSink(), as_objective(env), 0, 2)
    Trainer(spec, NullSink(), as_objective(env), 0, 1)  # one rank: fine


@pytest.mark.parametrize(("async_steps", "engine"), [
    (0, "batch"), (1, "batch"), (0, "continuous"), (1, "continuous")])
def test_code_repair_trains_with_feedback_turns_masked_out(tmp_path, monkeypatch, async_steps,
                                                           engine):
    """On either rollout engine (`continuous`: turn 2 reuses the keys of turn 1's context)."""
    sandbox = _sandbox()
    env = load_environment({"source": "builtin", "name": "code_repair",
                            "params": {"max_turns": 2}}, sandbox=sandbox)
    objective = as_objective(env)
    spec = parse_spec({
        "model": {"preset": {"num_layers": 1, "num_experts": 2, "experts_per_token": 1,
                             "hidden_size": 32, "moe_intermediate_size": 32}},
        "tokenizer": {"vocab_size": 400},
        "rollout": {"group_size": 2, "max_new_tokens": 6, "engine": engine},
        "algorithm": {"kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 1, "micro_batch_size": 2,
                    "eval_samples": 1, "zero_stage": 0, "max_async_steps": async_steps},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 0, "save_final": False},
        "output": {"stdout": False},
    })
    seen = []
    learn = Trainer.learn

    def spy(self, engine, sb, *args):
        seen.append((sb, self))
        return learn(self, engine, sb, *args)

    monkeypatch.setattr(Trainer, "learn", spy)
    from workers.rl.trainer import train

    result = train(spec, JsonlSink(tmp_path / "m.jsonl"), objective=objective)
    assert result.steps == 2 and set(result.eval_reward) == {0, 2}
    steps = [r for r in read_jsonl(tmp_path / "m.jsonl")
             if r["kind"] == "metrics" and "loss" in r["metrics"]]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        m = r["metrics"]
        assert m["episode/turns"] == 4  # a random policy fails: every episode takes 2 turns
        assert m["episode/env_tokens"] > 0 and m["episode/sampled_tokens"] > 0
        assert torch.isfinite(torch.tensor(m["loss"]))
    # Token in: the backend samples each turn from the episode's own ids, never re-encoded.
    assert all(r["metrics"]["episode/retokenized_turns"] == 0 for r in steps)
    if not async_steps:
        # One update per batch: the trained policy re-scores sampled tokens exactly as the
        # sampler did (ratio 1), so the logprobs line up with the attention layout,
        # environment tokens and all.
        assert all(abs(r["metrics"]["ratio_mean"] - 1.0) < 1e-3 for r in steps)
    sb, run = seen[0]
    batch = sb.batch
    assert isinstance(batch, EpisodeBatch)
    tok = run.episode_tok
    for row in range(batch.completion_ids.shape[0]):
        attn, lm = batch.completion_mask[row].bool(), batch.loss_mask[row].bool()
        env_ids = batch.completion_ids[row][attn & ~lm].tolist()
        assert "Your code failed the tests" in tok.decode(env_ids)  # the feedback turn
        sampled = batch.completion_ids[row][lm].tolist()
        assert "Your code failed" not in tok.decode(sampled)
        assert 0 < len(sampled) <= 2 * 6
        # sampled tokens carry the sampler's logprobs; everything else 0
        assert (batch.logprobs[row][~lm] == 0).all() and (batch.logprobs[row][lm] < 0).all()
