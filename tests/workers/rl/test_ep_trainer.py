"""Expert parallelism inside the trainer (`moe.expert_parallel`), composed with DeepSpeed ZeRO-2,
on real gloo ranks under torchrun: the same run with the experts sharded gives the data-parallel
run's losses and final weights, and a killed-and-resumed EP run replays the uninterrupted one."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workers.rl.test_rl_distributed import finish, launch, losses
from workers.rl.sinks import read_jsonl
from workers.rl.spec import RunSpec

# Absolute, on per-step losses and on every final weight. EP and DP compute the same sums in a
# different order: an expert's gradient is accumulated over the tokens of both ranks in one
# matmul (EP) instead of two half-sums added by the all-reduce (DP), and the expert forward is
# Crucible's grouped loop instead of transformers'. Float32 rounding of reordered sums of ~1e2
# terms is ~1e-6 relative; AdamW's first steps amplify gradient noise on near-zero entries up to
# one learning-rate step, so the bound on weights is a few lr (2e-3) times that noise. Measured
# here: see docs/moe.md.
LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-4

CONFIG = """
name = "ep"
[model]
seed = 3
[model.preset]
num_layers = 2
num_experts = 4
hidden_size = 32
moe_intermediate_size = 32
[sft]
steps = 0
[rollout]
group_size = 4
max_new_tokens = 4
[algorithm]
kl_coef = 0.02
[moe]
expert_parallel = {ep}
[trainer]
steps = {steps}
prompts_per_step = 4
micro_batch_size = 4
zero_stage = 2
precision = "fp32"
lr = 2e-3
schedule = "constant"
seed = 7
[checkpoint]
dir = "{{dir}}/ckpt"
every = {every}
keep = 4
[output]
metrics_jsonl = "{{dir}}/metrics.jsonl"
stdout = false
"""


def config(ep: int, steps: int = 4, every: int = 0) -> str:
    return CONFIG.format(ep=ep, steps=steps, every=every)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "ckpt" / "final" / "model.safetensors")


@pytest.mark.slow
def test_ep2_zero2_matches_data_parallel(tmp_path):
    """World 2: EP 2 (each rank half the experts) against DP only (both experts everywhere)."""
    dp_dir, ep_dir = tmp_path / "dp", tmp_path / "ep"
    finish(launch(dp_dir, config=config(1, every=1)), dp_dir)
    finish(launch(ep_dir, config=config(2)), ep_dir)
    dp, ep = losses(dp_dir), losses(ep_dir)
    assert sorted(ep) == sorted(dp) == [1, 2, 3, 4]
    for step in dp:
        assert abs(ep[step] - dp[step]) <= LOSS_TOL, (step, ep[step], dp[step])
    events = [r["message"] for r in read_jsonl(ep_dir / "metrics.jsonl") if r["kind"] == "event"]
    assert any("2 MoE layers sharded over groups of 2 ranks" in m for m in events)
    # The exported model is a normal HF checkpoint: every expert, gathered.
    w_dp, w_ep = final_weights(dp_dir), final_weights(ep_dir)
    assert w_ep.keys() == w_dp.keys()
    experts = [k for k in w_ep if "experts" in k]
    assert experts
    for k in w_dp:
        assert w_ep[k].shape == w_dp[k].shape, k
        assert torch.allclose(w_ep[k], w_dp[k], atol=WEIGHT_TOL, rtol=0), (
            k, float((w_ep[k] - w_dp[k]).abs().max()))
    # Steps 2-4 moved the experts well beyond the tolerance: the equality is not between two
    # barely trained copies.
    w1 = load_file(dp_dir / "ckpt" / "step-000001" / "hf" / "model.safetensors")
    assert max(float((w_ep[k] - w1[k]).abs().max()) for k in experts) > 10 * WEIGHT_TOL


@pytest.mark.slow
def test_ep2_checkpoint_resume_matches_uninterrupted(tmp_path):
    """DeepSpeed writes one file per expert from the EP rank owning it; a run resumed from its
    step-2 checkpoint gives the uninterrupted run's losses for steps 3 and 4."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    finish(launch(ref_dir, config=config(2, every=2)), ref_dir)
    ds = ref_dir / "ckpt" / "step-000002" / "ds"
    expert_files = sorted(p.name for p in ds.glob("layer_*_expert_*_model_states.pt"))
    assert len(expert_files) == 2 * 4  # 2 MoE layers x 4 experts
    finish(launch(run_dir, config=config(2, steps=2, every=2)), run_dir)
    # The same run, continued to 4 steps from its step-2 checkpoint.
    finish(launch(run_dir, "--resume", config=config(2, every=2)), run_dir)
    events = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "event"]
    assert any(e["message"].startswith("resumed from") and e["data"]["step"] == 2
               for e in events)
    ref, got = losses(ref_dir), losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(got[step] - ref[step]) <= 1e-6, (step, got[step], ref[step])


BASE = {"model": {"preset": {"num_experts": 4}}, "trainer": {"zero_stage": 2}}


def spec(**over) -> dict:
    doc = {k: dict(v) for k, v in BASE.items()}
    for section, values in over.items():
        doc[section] = {**doc.get(section, {}), **values}
    return doc


@pytest.mark.parametrize("over, message", [
    ({"moe": {"expert_parallel": 3}}, "must divide the number of experts"),
    ({"moe": {"expert_parallel": 2}, "trainer": {"zero_stage": 3}}, "zero_stage 0, 1 or 2"),
    ({"moe": {"expert_parallel": 2}, "trainer": {"zero_stage": 0, "grad_compression": "4bit"}},
     "grad_compression"),
    ({"moe": {"expert_parallel": 2}, "model": {"lora": {"r": 4}}}, "LoRA freezes the experts"),
    ({"moe": {"expert_parallel": 2}, "rollout": {"backend": "vllm"}}, "rollout.backend = 'hf'"),
    ({"moe": {"expert_parallel": 0}}, "greater than 0"),
])
def test_expert_parallel_spec_errors(over, message):
    with pytest.raises(ValueError, match=message):
        RunSpec.model_validate(spec(**over))


def test_expert_parallel_spec_accepts_zero_1_and_2():
    for stage in (0, 1, 2):
        s = RunSpec.model_validate(spec(moe={"expert_parallel": 2}, trainer={"zero_stage": stage}))
        assert s.moe.expert_parallel == 2


def test_world_size_must_be_divisible(tmp_path):
    """A world of one cannot hold EP groups of 2: refused before any phase starts."""
    from workers.rl.trainer import train

    s = RunSpec.model_validate(spec(moe={"expert_parallel": 2},
                                    checkpoint={"dir": str(tmp_path / "c")},
                                    output={"stdout": False}))
    with pytest.raises(ValueError, match="must divide the world size 1"):
        train(s)
