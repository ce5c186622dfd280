"""Named model configs, written as the published Hugging Face ``config.json`` values the
planner reads (only the keys it uses), so a person can plan without pasting a config.
Each entry names its source model repository."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The platform's own CPU preset (workers/rl/spec.py TinyMoeSpec defaults, the model
    # workers/rl/model.py builds, with the default 96-token trained tokenizer).
    "crucible-tiny-moe": {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "vocab_size": 96, "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    },
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    },
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "attention_bias": False,
    },
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "attention_bias": False,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3 (the main model; its multi-token-prediction layer, which
    # serving without speculative decoding does not load, is left out)
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
    },
}
