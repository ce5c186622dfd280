"""LoRA RL (model.lora): adapters only trained, the base as the KL reference, adapter weight
sync, checkpoints with the adapter in peft format, resume."""

import json

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from workers.rl import checkpoint as ckpt
from workers.rl.distributed import process_group
from workers.rl.engine import make_engine, weight_snapshot
from workers.rl.lean import LeanQwen3Moe
from workers.rl.lean import supported as lean_supported
from workers.rl.lora import (
    AdaptersOff,
    LoraTargetError,
    apply_lora,
    load_weights,
    merged_state,
    trainable_names,
)
from workers.rl.model import build_policy
from workers.rl.sinks import JsonlSink
from workers.rl.spec import LoraSpec, ModelSpec, TinyMoeSpec, TrainerSpec, parse_spec
from workers.rl.trainer import train

PRESET = {"num_layers": 2, "num_experts": 4, "hidden_size": 32, "moe_intermediate_size": 32}
IDS = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])


def lora_model(lora: LoraSpec | None = None) -> torch.nn.Module:
    spec = ModelSpec(preset=TinyMoeSpec(**PRESET), lora=lora or LoraSpec())
    return build_policy(spec, 96, 0, 1)


def base_model() -> torch.nn.Module:
    return build_policy(ModelSpec(preset=TinyMoeSpec(**PRESET)), 96, 0, 1)


def perturb_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Fresh adapters compute nothing (B = 0): give them weights that change the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_only_adapter_parameters_train_and_the_optimizer_sees_only_them():
    model = lora_model()
    names = {n for n, _ in model.named_parameters()}
    lora_names = {n for n in names if "lora_" in n}
    # two adapters (A, B) on each of 4 attention projections in each of 2 layers
    assert len(lora_names) == 2 * 4 * 2
    assert trainable_names(model) == lora_names
    assert all(".experts." not in n and "embed" not in n for n in lora_names)
    with process_group():
        engine = make_engine(model, TrainerSpec(zero_stage=0), 1e-3, 3, 2, 1, own_clip=True)
        opt_params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n)
    # the tiny MoE is mostly embeddings and experts: 5120 of 48608 parameters train
    assert sum(p.numel() for p in opt_params) < 0.15 * sum(p.numel() for p in model.parameters())


def test_lora_spec_is_validated_and_expert_mlps_are_refused():
    with pytest.raises(ValidationError, match="stacked 3-d parameters"):
        LoraSpec(target_modules=("q_proj", "experts"))
    with pytest.raises(ValidationError, match="at least one"):
        LoraSpec(target_modules=())
    with pytest.raises(ValidationError):
        LoraSpec(r=0)
    with pytest.raises(ValidationError):
        LoraSpec(dropout=1.0)
    with pytest.raises(LoraTargetError, match=r"gate \(not an nn.Linear\)"):
        apply_lora(base_model(), LoraSpec(target_modules=("q_proj", "gate")))
    with pytest.raises(LoraTargetError, match=r"w9 \(no such module\)"):
        apply_lora(base_model(), LoraSpec(target_modules=("w9",)))
    # the frozen config names lora only when it is set
    assert "lora" not in parse_spec({}).model_dump()["model"]
    on = parse_spec({"model": {"lora": {"r": 4}}}).model_dump()["model"]["lora"]
    assert on["r"] == 4 and on["target_modules"] == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_reference_is_the_base_with_adapters_disabled():
    model = lora_model()
    perturb_adapters(model)
    base = logits(base_model())
    assert not torch.allclose(logits(model), base)  # the adapters matter ...
    ref = AdaptersOff(model)
    assert torch.equal(ref(input_ids=IDS).logits, base)  # ... and off, it is the base exactly
    assert list(ref.parameters()) == []  # no second copy of the weights
    assert not torch.equal(logits(model), base)  # leaving the context turns them back on


def test_adapter_sync_gives_the_rollout_copy_the_learners_logits():
    learner = lora_model()
    perturb_adapters(learner)
    snap = weight_snapshot(learner, 0)
    assert snap and all("lora_" in k for k in snap)  # adapters only travel
    rollout = lora_model()  # the actor's own copy: same base, fresh adapters
    assert not torch.equal(logits(rollout), logits(learner))
    load_weights(rollout, snap)
    assert torch.equal(logits(rollout), logits(learner))
    with pytest.raises(KeyError, match="adapter snapshot keys differ"):
        load_weights(rollout, {k: v for k, v in list(snap.items())[1:]})
    # a backend that needs full weights (vLLM) gets them merged, under the plain model's names
    plain = base_model()
    plain.load_state_dict(weight_snapshot(learner, 0, merged=True))
    assert torch.allclose(logits(plain), logits(learner), atol=1e-5)
    assert merged_state(learner).keys() == base_model().state_dict().keys()


def test_training_steps_move_adapters_and_leave_base_weights_bit_identical():
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with process_group():
        engine = make_engine(model, TrainerSpec(zero_stage=0), 1e-2, 3, 2, 1, own_clip=True)
        for _ in range(3):
            loss = engine(input_ids=IDS, labels=IDS).loss
            assert torch.isfinite(loss)
            engine.backward(loss)
            engine.step()
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n


def run_spec(tmp_path, steps: int, **extra):
    data = {
        "model": {"preset": PRESET, "lora": {"r": 4, "alpha": 8}},
        "sft": {"steps": 0},
        "algorithm": {"kl_coef": 0.05},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"steps": steps, "prompts_per_step": 2, "micro_batch_size": 4,
                    "lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1, "keep": 5},
        "output": {"stdout": False},
    }
    for k, v in extra.items():
        data[k] = {**data.get(k, {}), **v}
    return parse_spec(data)


def test_three_step_lora_run_checkpoints_adapters_and_a_merged_model(tmp_path):
    result = train(run_spec(tmp_path, 3), JsonlSink(tmp_path / "m.jsonl"))
    assert sorted(result.losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    last = tmp_path / "ckpt" / "step-000003" / "hf"
    adapter = last / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj",
                                                               "v_proj"]
    base_ref = json.loads((adapter / "base.json").read_text())
    assert base_ref["source"] == "preset" and base_ref["seed"] == 0
    saved = load_file(adapter / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # B left 0
    # the adapter applied to the rebuilt base = the merged hf/ model = the final artifact
    merged = AutoModelForCausalLM.from_pretrained(last, local_files_only=True)
    c = merged.config
    base = build_policy(ModelSpec(**base_ref), c.vocab_size, c.pad_token_id, c.eos_token_id)
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    via_peft = PeftModel.from_pretrained(base, adapter)
    final = AutoModelForCausalLM.from_pretrained(result.final_dir, local_files_only=True)
    assert torch.allclose(logits(via_peft), logits(merged), atol=1e-5)
    assert torch.equal(logits(merged), logits(final))
    # weights outside the adapted projections are the base's, bit for bit
    for k, v in merged.state_dict().items():
        if not any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj")):
            assert torch.equal(v, base_sd[k]), k
    # DeepSpeed state holds the adapters only, not the frozen base
    ds_files = list((last.parent / "ds").glob("*model_states.pt"))
    module = torch.load(ds_files[0], weights_only=False)["module"]
    assert module and all("lora_" in k for k in module)


def test_lora_run_resumes_from_its_checkpoint_and_continues(tmp_path):
    spec = run_spec(tmp_path, 2)
    train(spec, JsonlSink(tmp_path / "a.jsonl"))
    step2 = tmp_path / "ckpt" / "step-000002"
    saved = load_file(step2 / "hf" / "adapter" / "adapter_model.safetensors")
    cfg = AutoModelForCausalLM.from_pretrained(step2 / "hf", local_files_only=True).config
    # the load path resume takes: a rebuilt base + fresh adapters, then ds/ (adapters only)
    with process_group():
        model = build_policy(spec.model, cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
        engine = make_engine(model, spec.trainer, spec.trainer.lr, 2, 4, 2, own_clip=True)
        assert ckpt.load(engine, step2)["step"] == 2
    restored = {k.replace(".default", ""): v for k, v in model.state_dict().items()
                if "lora_" in k}
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    # and the run itself continues from there to step 3
    resumed = train(run_spec(tmp_path, 3), JsonlSink(tmp_path / "b.jsonl"), resume=True)
    assert sorted(resumed.losses) == [3] and torch.isfinite(torch.tensor(resumed.losses[3]))
    assert ckpt.list_checkpoints(tmp_path / "ckpt")[-1].name == "step-000003"


@pytest.mark.parametrize("sections", [{"trainer": {"max_async_steps": 1}},
                                      {"trainer": {"zero_stage": 3}},
                                      {"moe": {"router_replay": True}},
                                      {"sft": {"steps": 3, "batch_size": 8},
                                       "algorithm": {"dpo_coef": 0.1}}],
                         ids=["async-actor", "zero3", "router-replay", "sft-warm-start"])
def test_lora_runs_with_the_async_actor_zero3_and_router_replay(tmp_path, sections):
    """The async actor gets adapter-only snapshots through the WeightStore (a strict key
    check in `load_weights`); ZeRO-3 gathers the adapters and saves a frozen-free ds/; router
    replay finds the routers through the peft wrapper (its per-step check would fail loudly);
    a LoRA SFT warm start saves a merged model, which RL then puts fresh adapters on."""
    result = train(run_spec(tmp_path, 3, **sections), JsonlSink(tmp_path / "m.jsonl"))
    assert sorted(result.losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    final = AutoModelForCausalLM.from_pretrained(result.final_dir, local_files_only=True)
    assert torch.isfinite(logits(final)).all()


def test_lean_forward_folds_the_adapters_and_trains_them():
    """The lean Qwen3-MoE forward (fast sampling and training) folds B·A·scale into its fused
    projections: the same logits as peft's forward up to rounding, and the same adapter
    gradients; with dropout (no per-token mask in the fold) it steps aside."""
    model = lora_model()
    perturb_adapters(model)
    assert lean_supported(model)
    mask = torch.ones_like(IDS)
    lean_logits, _ = LeanQwen3Moe(model, 0, IDS.shape[1]).train_forward(IDS, mask)
    ref_logits = model(input_ids=IDS, attention_mask=mask).logits
    assert torch.allclose(lean_logits, ref_logits, atol=1e-5)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    g_lean = torch.autograd.grad(lean_logits.square().mean(), adapters)
    g_ref = torch.autograd.grad(ref_logits.square().mean(), adapters)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_lean, g_ref, strict=True))
    assert all(g.abs().sum() > 0 for g in g_lean)
    assert not lean_supported(lora_model(LoraSpec(dropout=0.1)))
    # the model's own forward (the adapters-off reference runs one) leaves transformers'
    # inert output-capturing hooks behind; the lean path must stay available after it
    AdaptersOff(model)(input_ids=IDS)
    assert lean_supported(model)
