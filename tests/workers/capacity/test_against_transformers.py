"""The planner's parameter counts against real models: transformers builds small models of
each supported family from a config (no download) and counts their parameters, so a kind
of weight the planner forgets (a bias, a norm, a gate) fails here."""

from __future__ import annotations

import pytest

from workers.capacity.shapes import shape_from_config

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 97, "intermediate_size": 96,
         "tie_word_embeddings": False}
CASES = {
    "llama": ("LlamaConfig", {**SMALL, "attention_bias": True}),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen3": ("Qwen3Config", {**SMALL, "head_dim": 24}),
    "qwen3_moe": ("Qwen3MoeConfig", {**SMALL, "head_dim": 16, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "mlp_only_layers": [1]}),
    "qwen2_moe": ("Qwen2MoeConfig", {**SMALL, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48}),
    "mixtral": ("MixtralConfig", {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", {**SMALL, "num_key_value_heads": 4,
                                         "n_routed_experts": 8, "n_shared_experts": 1,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "first_k_dense_replace": 1, "q_lora_rank": 48,
                                         "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                         "qk_rope_head_dim": 8, "v_head_dim": 16,
                                         "n_group": 1, "topk_group": 1}),
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_parameter_count_matches_the_built_model(model_type: str) -> None:
    cls_name, values = CASES[model_type]
    config = getattr(transformers, cls_name)(**values)
    model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    planned = shape_from_config(config.to_dict()).params().total
    assert planned == built, (model_type, planned, built)
