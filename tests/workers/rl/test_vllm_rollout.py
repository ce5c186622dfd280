"""The vLLM rollout backend. Its pure parts (weight naming, logprob extraction, batch layout,
version bookkeeping, stalled-push detection) run everywhere; the engine tests need a CUDA
machine with vLLM (`pip install .[gpu]`) and skip elsewhere, saying so."""

from __future__ import annotations

import importlib.util
import math
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tests.skips import host_reason
from workers.rl.model import build_policy
from workers.rl.rollout import position_ids
from workers.rl.spec import ModelSpec, RolloutSpec, TinyMoeSpec
from workers.rl.spec_data import VllmSpec
from workers.rl.vllm_rollout import (
    VllmRollout,
    VllmUnavailable,
    WeightSyncError,
    WeightVersions,
    assemble_batch,
    checkpoint_named_weights,
    run_with_timeout,
    sampled_logprobs,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# A host skip (tests/skips.py): `make test` does not install the GPU extra, which is only
# useful, and only installable with its CUDA torch, on a GPU pool's host.
GPU_REASON = host_reason(
    "the vLLM engine test needs a CUDA GPU and vLLM (`pip install .[gpu]`); this machine has "
    f"cuda={torch.cuda.is_available()}, vllm={HAS_VLLM}"
)
needs_gpu = pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason=GPU_REASON)


@dataclass
class Logprob:
    """The shape of `vllm.logprobs.Logprob` (vLLM is not installed on CPU machines)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def completion(token_ids, lps, text):
    """A `RequestOutput` as vLLM returns it: `.outputs[0]` is a `CompletionOutput` whose
    `logprobs` hold one {token id: Logprob} per generated token (logprobs=0: just the sampled
    one; a top-k request adds alternatives)."""
    positions = [{t: Logprob(lp, 1), 3: Logprob(-9.0, 2)} for t, lp in zip(token_ids, lps,
                                                                        strict=True)]
    out = SimpleNamespace(index=0, text=text, token_ids=tuple(token_ids), logprobs=positions,
                          finish_reason="stop", cumulative_logprob=sum(lps))
    return SimpleNamespace(outputs=[out], prompt_token_ids=[])


def test_sampled_logprobs_pick_the_sampled_token_at_each_position():
    got = sampled_logprobs([5, 7], [{5: Logprob(-0.5), 9: Logprob(-2.0)}, {7: Logprob(-1.25)}])
    assert got == [-0.5, -1.25]
    assert sampled_logprobs([4], [{4: -0.75}]) == [-0.75]
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs([1], None)
    with pytest.raises(ValueError, match="2 logprob positions for 1 tokens"):
        sampled_logprobs([1], [{1: -1.0}, {2: -1.0}])
    with pytest.raises(ValueError, match="sampled token 6 at position 0"):
        sampled_logprobs([6], [{5: Logprob(-1.0)}])


def test_assemble_batch_matches_the_hf_layout(tokenizer):
    enc = tokenizer(["1+2=", "10+20="], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    three = tokenizer("3", add_special_tokens=False)["input_ids"]
    thirty = tokenizer("30\n", add_special_tokens=False)["input_ids"]
    outs = [completion(three + [eos], [-0.1] * (len(three) + 1), "3"),
            completion(thirty, [-0.2] * len(thirty), "30\n")]
    batch = assemble_batch(enc["input_ids"], enc["attention_mask"], outs, pad, ["\n"])
    assert torch.equal(batch.prompt_ids, enc["input_ids"])  # left-padded, as HFRollout
    width = max(len(three) + 1, len(thirty))
    assert batch.completion_ids.shape == (2, width)
    assert batch.completion_ids[0, : len(three) + 1].tolist() == three + [eos]
    assert batch.completion_mask.sum(1).tolist() == [len(three) + 1, len(thirty)]
    assert batch.completion_ids[batch.completion_mask == 0].eq(pad).all()
    assert batch.logprobs[batch.completion_mask == 0].eq(0).all()
    assert batch.logprobs[1, : len(thirty)].tolist() == pytest.approx([-0.2] * len(thirty))
    assert batch.texts == ["3", "30"]  # cut at the first stop string, like HFRollout
    with pytest.raises(ValueError, match="1 vLLM outputs for 2 prompts"):
        assemble_batch(enc["input_ids"], enc["attention_mask"], outs[:1], pad, [])


def test_weight_names_are_the_checkpoint_names_transformers_writes(tmp_path, tokenizer):
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=2)), len(tokenizer),
                         tokenizer.pad_token_id, tokenizer.eos_token_id)
    state = model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # fused in memory
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ours = dict(checkpoint_named_weights(state))
    assert sorted(ours) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name


def test_weight_versions_only_move_forward_and_a_failed_push_poisons():
    v = WeightVersions()
    v.begin(1)
    assert v.commit() == 1
    with pytest.raises(ValueError, match="not newer than the loaded version 1"):
        v.begin(1)
    v.begin(3)
    v.fail("push of version 3 timed out")
    with pytest.raises(WeightSyncError, match="timed out.*rebuild the backend"):
        v.check()
    with pytest.raises(WeightSyncError):
        v.begin(4)
    assert v.current == 1


def test_a_stalled_push_fails_loudly_instead_of_hanging():
    release = threading.Event()
    with pytest.raises(WeightSyncError, match="pushing weights did not finish in 0 s"):
        run_with_timeout(release.wait, 0.2, "pushing weights")
    release.set()
    with pytest.raises(WeightSyncError, match="failed: boom"):
        run_with_timeout(lambda: (_ for _ in ()).throw(RuntimeError("boom")), 5, "push")
    assert run_with_timeout(lambda: 7, 5, "push") == 7


def test_vllm_spec_validation():
    assert VllmSpec().enable_prefix_caching and VllmSpec().enable_chunked_prefill
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        VllmSpec(gpu_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="without chunked prefill"):
        VllmSpec(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=512)


@pytest.mark.skipif(HAS_VLLM, reason=host_reason("vLLM is installed here; the missing-vLLM "
                                              "error cannot be shown"))
def test_missing_vllm_names_the_gpu_extra(tmp_path, tokenizer):
    with pytest.raises(VllmUnavailable, match=r"pip install \.\[gpu\]"):
        VllmRollout(tmp_path, tokenizer, VllmSpec())


# ---- on a GPU with vLLM ----------------------------------------------------------------------


def _gpu_policy(tokenizer):
    """A tiny Qwen3-MoE whose head size vLLM's attention kernels support."""
    preset = TinyMoeSpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                         num_experts=8, experts_per_token=2, moe_intermediate_size=128,
                         max_position_embeddings=256)
    return build_policy(ModelSpec(preset=preset), len(tokenizer), tokenizer.pad_token_id,
                        tokenizer.eos_token_id)


def _rescore(model, batch, temperature):
    """The trainer's view: log-probs of the sampled tokens under `model`."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).cuda()
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).cuda()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    p = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1].float() / temperature, -1)
    return logp.gather(-1, batch.completion_ids.cuda()[..., None]).squeeze(-1).cpu()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    if not (HAS_VLLM and torch.cuda.is_available()):
        pytest.skip(GPU_REASON)
    out = tmp_path_factory.mktemp("vllm-policy")
    model = _gpu_policy(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    backend = VllmRollout(out, tokenizer, VllmSpec(gpu_memory_utilization=0.25, dtype="bfloat16",
                                                   max_model_len=256, enforce_eager=True))
    return backend, model.cuda().eval()


@needs_gpu
def test_vllm_samples_with_the_hf_contract_and_true_logprobs(engine, tokenizer):
    backend, model = engine
    spec = RolloutSpec(max_new_tokens=8, temperature=0.9, stop=["\n"])
    prompts = ["1+2=", "1+2=", "30+40=", "30+40="]
    g = torch.Generator().manual_seed(0)
    batch = backend.generate(prompts, spec, g)
    assert batch.prompt_ids.shape[0] == 4 and batch.completion_ids.shape[1] <= 8
    assert batch.completion_mask[:, 0].eq(1).all()
    mask = batch.completion_mask.bool()
    ref = _rescore(model, batch, 0.9)  # fp32 on the trainer's side, bf16 in vLLM
    assert (batch.logprobs[mask] - ref[mask]).abs().max() < 0.05
    again = backend.generate(prompts, spec, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, batch.completion_ids)  # seeded per request


@needs_gpu
def test_vllm_weight_push_is_versioned_and_takes_effect(engine, tokenizer):
    backend, model = engine
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.zero_()  # every token equally likely afterwards
    before = backend.version
    backend.load_state(model.state_dict(), before + 1)
    assert backend.version == before + 1
    assert backend.worker_versions() == [before + 1]
    batch = backend.generate(["1+2="] * 4, RolloutSpec(max_new_tokens=4, temperature=1.0),
                             torch.Generator().manual_seed(1))
    lp = batch.logprobs[batch.completion_mask.bool()]
    assert torch.allclose(lp, torch.full_like(lp, -math.log(len(tokenizer))), atol=1e-3)
    with pytest.raises(ValueError, match="not newer"):
        backend.load_state(model.state_dict(), before + 1)


def test_rope_scaling_becomes_vllm_hf_overrides():
    """vLLM's long-context recipe: `hf_overrides={"rope_parameters": ...}` keeping the
    checkpoint's rope_theta, with the original context defaulting to the checkpoint's."""
    spec = VllmSpec(max_model_len=131072, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    config = {"max_position_embeddings": 32768,
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    assert spec.rope_scaling is not None
    assert spec.rope_scaling.overrides(config) == {"rope_parameters": {
        "rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768}}
    with pytest.raises(ValidationError, match="factor"):
        VllmSpec(rope_scaling={"factor": 0.5})
    with pytest.raises(ValidationError, match="rope_type"):
        VllmSpec(rope_scaling={"rope_type": "ntk-magic"})
