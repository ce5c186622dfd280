"""pass@k that means pass@k: each sample of a task is drawn with its own seed, derived from the
spec's seed and the (task, sample) index, so samples differ and a seeded evaluation repeats
exactly. Checked with a policy that reads the seed it is sent, and with a sampled model served
by the real inference server."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from workers.envs import load_environment
from workers.envs.base import Message
from workers.envs.eval import Completion, EndpointPolicy, evaluate, sample_seed
from workers.envs.spec import EndpointPolicySpec, SamplingSpec

TASKS = [{"id": f"t{i}", "prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3)}
         for i in range(12)]
ENV = {"source": "tasks", "tasks": [{**t, "split": "eval"} for t in TASKS],
       "rubric": {"components": [{"name": "correct", "checker": "exact_match"}]}}


class CoinPolicy:
    """Answers right when a coin seeded by the request's seed lands heads: what a sampled
    model does, with the seed as its only source of randomness."""

    name = "coin"

    def __init__(self) -> None:
        self.answers = {t["prompt"]: t["answer"] for t in TASKS}
        self.seeds: list[int | None] = []

    def chat(self, messages: Sequence[Message], sampling: SamplingSpec) -> Completion:
        self.seeds.append(sampling.seed)
        heads = random.Random(sampling.seed).random() < 0.5
        return Completion(text=self.answers[messages[-1]["content"]] if heads else "no idea")


def _stable(report: dict[str, Any]) -> dict[str, Any]:
    """The report without wall-clock fields (latencies, timings, start time)."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if k not in ("latency_s", "timings", "started_at")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return strip(report)


def test_sample_seeds_are_derived_from_the_spec_seed_task_and_sample() -> None:
    assert sample_seed(7, "t1", 0) == sample_seed(7, "t1", 0)
    seeds = {sample_seed(7, t, s) for t in ("t1", "t2") for s in range(4)}
    assert len(seeds) == 8  # every (task, sample) its own
    assert sample_seed(8, "t1", 0) != sample_seed(7, "t1", 0)
    assert sample_seed(7, "t1", 0, turn=1) != sample_seed(7, "t1", 0)
    assert all(0 <= s < 2**31 for s in seeds)


def test_samples_differ_so_pass_at_4_exceeds_pass_at_1_and_reruns_repeat() -> None:
    env = load_environment(ENV)
    policy = CoinPolicy()
    sampling = SamplingSpec(max_tokens=4, temperature=1.0, seed=11)
    report = evaluate(env, policy, samples_per_task=4, k=[1, 4], sampling=sampling,
                      include_samples=True)
    assert len(set(policy.seeds)) == 12 * 4  # no two requests share a seed
    s = report["summary"]["pass_at"]
    assert s["4"] > s["1"], s
    # Each task's pass@1 is its share of correct samples: a coin gives mixed tasks.
    assert any(0 < row["correct"] < 4 for row in report["tasks"])
    again = evaluate(env, CoinPolicy(), samples_per_task=4, k=[1, 4], sampling=sampling,
                     include_samples=True)
    assert _stable(again) == _stable(report)
    # The report names the spec's seed, not the derived ones.
    assert report["policy"]["sampling"]["seed"] == 11


def test_without_a_seed_nothing_is_sent() -> None:
    env = load_environment(ENV)
    policy = CoinPolicy()
    evaluate(env, policy, samples_per_task=2, k=[1], limit=2,
             sampling=SamplingSpec(temperature=1.0, seed=None))
    assert policy.seeds == [None] * 4


@pytest.fixture(scope="module")
def sampled_server(tmp_path_factory):
    """A tiny random Qwen3-MoE (digits and operators in its vocabulary) served over the
    OpenAI-compatible API, sampled at temperature 1."""
    import torch

    from workers.inference import start_server
    from workers.rl.model import build_policy
    from workers.rl.objectives import build_objective
    from workers.rl.spec import ArithmeticSpec, ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    torch.set_num_threads(1)
    tok = train_bpe(build_objective(ArithmeticSpec()).corpus(), vocab_size=96)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=2)), len(tok),
                         tok.pad_token_id, tok.eos_token_id)
    out = tmp_path_factory.mktemp("sampled-policy")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    with start_server(out, name="tiny", chat_format="raw") as server:
        yield server


@pytest.mark.slow
def test_a_sampled_model_scores_higher_pass_at_4_than_pass_at_1(sampled_server) -> None:
    # "Starts with a digit": a random policy over this vocabulary passes some samples of a
    # task and fails others, which only independent samples can show.
    env = load_environment({**ENV, "rubric": {"components": [
        {"name": "digit_first", "checker": "regex", "params": {"pattern": r"^\s*\d"}}]}})
    sampling = SamplingSpec(max_tokens=2, temperature=1.0, seed=5)

    def run() -> dict[str, Any]:
        policy = EndpointPolicy(EndpointPolicySpec(base_url=sampled_server.url, model="tiny"))
        try:
            return evaluate(env, policy, samples_per_task=4, k=[1, 4], sampling=sampling,
                            include_samples=True, concurrency=2)
        finally:
            policy.close()

    first = run()
    assert first["summary"]["errors"] == 0
    answers = [s["final_answer"] for s in first["samples"]]
    assert len(set(answers)) > 1
    p = first["summary"]["pass_at"]
    assert p["4"] > p["1"], (p, answers)
    second = run()
    assert [s["final_answer"] for s in second["samples"]] == answers
    assert _stable(second) == _stable(first)
