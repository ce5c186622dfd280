"""verifiers compatibility: a v1 taskset (defined in tests/workers/envs/vf_arith.py) is listed,
answered by our policy through our OpenAI-compatible inference server, and scored by its own
`@vf.reward` functions."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers>=0.4 (the 'envs' extra) is not installed")

from workers.envs import load_environment  # noqa: E402
from workers.envs.eval import CallablePolicy, EndpointPolicy, evaluate  # noqa: E402
from workers.envs.spec import EndpointPolicySpec, SamplingSpec  # noqa: E402
from workers.envs.verifiers_compat import VerifiersError  # noqa: E402

SPEC = {"source": "verifiers", "module": "tests.workers.envs.vf_arith", "eval_fraction": 0.25}


def test_tasks_are_listed_with_ids_splits_and_metadata() -> None:
    env = load_environment(SPEC)
    assert len(env.tasks) == 12 and len(env.split("eval")) == 3
    task = env.task("sum-2-1")
    assert task.prompt == "2+1=" and task.answer == "3" and task.difficulty == "easy"
    assert [c.name for c in env.rubric.components] == ["correct", "short"]
    assert [c.weight for c in env.rubric.components] == [1.0, 0.25]
    assert env.params["taskset"] == "SumTaskset" and len(env.params["source_sha256"]) == 64
    assert env.content_hash() == load_environment(SPEC).content_hash()


def test_scores_come_from_the_tasksets_own_rewards() -> None:
    env = load_environment(SPEC)
    task = env.task("sum-3-2")
    right, long_wrong, empty = env.score([task] * 3, ["5", "the answer is six", ""])
    assert right.total == 1.25 and right.components == {"correct": 1.0, "short": 1.0}
    assert right.info["metrics"] == {"chars": 1.0}
    assert long_wrong.total == 0.0 and empty.total == 0.0
    # The same numbers as calling verifiers directly on its own trace.
    [trace] = env._traces([task], ["5"])  # noqa: SLF001 - checking against the library itself
    asyncio.run(env.vf_tasks[task.id].score(trace))
    assert trace.reward == right.total


def test_qc_and_the_rl_adapter_work_on_a_verifiers_environment() -> None:
    from workers.envs import as_objective
    from workers.qc import run_qc_spec

    report = run_qc_spec(SPEC)
    assert report["passed"] and report["summary"]["reference_full_reward"] == 12
    rl = as_objective(load_environment(SPEC))
    totals, parts = rl.reward(rl.eval, [e.reference for e in rl.eval])
    assert totals == [1.25] * 3 and parts["correct"] == [1.0] * 3


def test_packages_that_need_a_runtime_or_do_not_export_a_taskset_are_refused() -> None:
    with pytest.raises(VerifiersError, match="scores with a runtime"):
        load_environment({"source": "verifiers", "module": "tests.workers.envs.vf_needs_runtime"})
    with pytest.raises(VerifiersError, match="defines no __all__"):
        load_environment({"source": "verifiers", "module": "tests.workers.envs.conftest"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE saved like an RL checkpoint (no downloads)."""
    import torch

    from workers.rl.model import build_policy
    from workers.rl.objectives import build_objective
    from workers.rl.spec import ArithmeticSpec, ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    torch.set_num_threads(1)
    tok = train_bpe(build_objective(ArithmeticSpec()).corpus(), vocab_size=96)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=2)), len(tok),
                         tok.pad_token_id, tok.eos_token_id)
    out = tmp_path_factory.mktemp("policy")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def inference_server(model_dir):
    inference = pytest.importorskip("workers.inference", reason="inference server missing")
    with inference.start_server(model_dir, name="tiny", api_key="k", chat_format="raw") as srv:
        yield srv


@pytest.mark.slow
def test_our_policy_answers_through_the_openai_endpoint(inference_server, monkeypatch) -> None:
    monkeypatch.setenv("CRUCIBLE_TEST_KEY", "k")
    env = load_environment(SPEC)
    policy = EndpointPolicy(EndpointPolicySpec(base_url=inference_server.url, model="tiny",
                                               api_key_env="CRUCIBLE_TEST_KEY"))
    report = evaluate(env, policy, samples_per_task=2, k=[1, 2], include_samples=True,
                      sampling=SamplingSpec(max_tokens=4, temperature=1.0, seed=3),
                      concurrency=2)
    s = report["summary"]
    assert s["tasks"] == 3 and s["samples"] == 6 and s["errors"] == 0
    assert s["completion_tokens_per_task"] is not None and s["prompt_tokens_per_task"] > 0
    # Every sample's reward is what the taskset's own rubric gives that text.
    samples = report["samples"]
    rescored = env.score([env.task(x["task_id"]) for x in samples],
                         [x["final_answer"] for x in samples])
    assert [x["reward"] for x in samples] == [r.total for r in rescored]
    assert all(x["components"]["short"] > 0 or len(x["final_answer"]) > 8
               or not x["final_answer"] for x in samples)
    # A correct policy through the same report path scores full marks.
    answers = {t.prompt: t.answer for t in env.tasks}
    perfect = evaluate(env, CallablePolicy(lambda m: answers[m[-1]["content"]]), k=[1])
    assert perfect["summary"]["pass_at"]["1"] == 1.0 and perfect["summary"]["mean_reward"] == 1.25


def test_endpoint_errors_are_reported_per_sample(monkeypatch) -> None:
    env = load_environment(SPEC)
    policy = EndpointPolicy(EndpointPolicySpec(base_url="http://127.0.0.1:9", model="x",
                                               timeout_s=2))
    report = evaluate(env, policy, limit=1)
    assert report["summary"]["errors"] == 1 and report["summary"]["mean_reward"] == 0.0
    assert "request failed" in report["tasks"][0]["errors"][0]


@pytest.mark.slow
def test_run_eval_serves_a_checkpoint_for_the_evaluation(model_dir) -> None:
    from workers.inference.eval import run_eval

    eval_spec = {"policy": {"kind": "checkpoint", "uri": model_dir.as_uri()}, "limit": 2,
                 "samples_per_task": 2, "k": [1, 2], "sampling": {"max_tokens": 3}}
    report = run_eval({"source": "builtin", "name": "arithmetic"}, eval_spec)
    assert report["summary"]["tasks"] == 2 and report["summary"]["errors"] == 0
    assert report["policy"]["checkpoint"] == model_dir.as_uri()
    with pytest.raises(ValueError, match="not local"):
        run_eval({"source": "builtin", "name": "arithmetic"},
                 {"policy": {"kind": "checkpoint", "uri": "s3://bucket/ckpt"}})


def test_a_split_named_in_the_task_data_is_honoured() -> None:
    env = load_environment({"source": "verifiers", "module": "tests.workers.envs.vf_split",
                            "eval_fraction": 0.2})
    # "test" means held out: exactly the package's four, whatever eval_fraction says.
    assert sorted(t.id for t in env.split("eval")) == ["e6", "e7", "e8", "e9"]
    assert len(env.split("train")) == 6
    from workers.envs import as_objective

    assert sorted(e.meta["task_id"] for e in as_objective(env).eval) == ["e6", "e7", "e8", "e9"]


def test_an_unknown_split_name_is_refused(monkeypatch) -> None:
    from tests.workers.envs import vf_split

    original = vf_split.EchoData

    class Odd(original):  # type: ignore[misc, valid-type]
        pass

    def load(self):
        yield vf_split.EchoTask(Odd(id="x", prompt="p", answer="1", split="holdout-ish"),
                                self.config.task)

    monkeypatch.setattr(vf_split.EchoTaskset, "load", load)
    with pytest.raises(VerifiersError, match="task 'x' has split 'holdout-ish'; use one of"):
        load_environment({"source": "verifiers", "module": "tests.workers.envs.vf_split"})
