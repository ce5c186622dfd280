"""The capacity planner against values computed by hand from the published configs.

Config values below are Qwen/Qwen3-30B-A3B's, Qwen/Qwen3-235B-A22B's and Qwen/Qwen3-8B's
config.json (the same values as slime's Megatron scripts for these models: 32/64 heads,
4 query groups, kv-channels 128, 48/94 layers, hidden 2048/4096, moe-ffn 768/1536, 128
experts, top-8, vocab 151936, untied embeddings). Every expected number is worked out in
the comments, not read back from the code."""

from __future__ import annotations

import pytest

from workers.capacity.plan import (
    Layout,
    Request,
    decode_weight_bytes_per_token,
    expected_experts_touched,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    logits_bytes,
    plan,
    plan_layout,
    prefill_activation_bytes,
    tp_problem,
    weight_bytes,
)
from workers.capacity.presets import PRESETS
from workers.capacity.shapes import ConfigError, shape_from_config

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
}
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 94, "num_attention_heads": 64, "moe_intermediate_size": 1536,
    "max_window_layers": 94,
}
QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
}


def test_qwen3_30b_a3b_parameters() -> None:
    s = shape_from_config(QWEN3_30B_A3B)
    p = s.params()
    # attention per layer: q 2048*4096 = 8,388,608; k, v 2048*512 = 1,048,576 each;
    # o 4096*2048 = 8,388,608 -> 18,874,368; x 48 layers = 905,969,664
    assert p.attention == 905_969_664
    # experts per layer: 128 * 3 * 2048 * 768 = 603,979,776; x 48 = 28,991,029,248
    assert s.expert_params() == 4_718_592
    assert p.experts == 28_991_029_248
    # router 2048*128 = 262,144 per layer; x 48 = 12,582,912
    assert p.router == 12_582_912
    # norms: (input + post-attention 2*2048 + q_norm, k_norm 2*128) * 48 + final 2048
    assert p.norms == (4096 + 256) * 48 + 2048 == 210_944
    # embedding and untied lm_head: 151,936 * 2048 = 311,164,928 each
    assert p.embedding == p.lm_head == 311_164_928
    assert p.dense_mlp == p.shared_experts == 0
    # total 30,532,122,624 (the model card's "30.5B")
    assert p.total == 30_532_122_624
    # active: all but 120 idle experts per layer: 30,532,122,624 - 48*120*4,718,592
    # = 30,532,122,624 - 27,179,089,920 = 3,353,032,704 (the card's "3.3B")
    assert s.active_params() == 3_353_032_704


def test_qwen3_30b_a3b_memory() -> None:
    s = shape_from_config(QWEN3_30B_A3B)
    # quantisable = attention + experts = 905,969,664 + 28,991,029,248 = 29,896,998,912;
    # kept in bf16 = embedding + lm_head + router + norms = 635,123,712 (x2 = 1,270,247,424)
    assert weight_bytes(s, "bf16") == 30_532_122_624 * 2 == 61_064_245_248
    assert weight_bytes(s, "fp8") == 29_896_998_912 + 1_270_247_424 == 31_167_246_336
    assert weight_bytes(s, "int8") == weight_bytes(s, "fp8")
    assert weight_bytes(s, "int4") == 14_948_499_456 + 1_270_247_424 == 16_218_746_880
    # KV per token: 48 layers * 2 (K, V) * 4 KV heads * 128 * 2 bytes = 98,304 (96 KiB)
    assert kv_bytes_per_token(s) == 98_304
    assert kv_bytes_per_token(s, "fp8") == 49_152
    # one 32k-token sequence: 98,304 * 32,768 = 3,221,225,472 (3 GiB); 32 of them 96 GiB
    assert kv_bytes_per_sequence(s, 32_768) == 3_221_225_472
    # prefill chunk of 8192 tokens, bf16: attention stage 8192*(2*2048 + (32+8)*128 +
    # 32*128)*2 = 8192*13,312*2 = 218,103,808; MoE stage 8192*(2*2048 + 8*3*768)*2 +
    # 8192*128*4 (fp32 router logits) = 369,098,752 + 4,194,304 = 373,293,056: the larger
    assert prefill_activation_bytes(s, 8192) == 373_293_056
    # logits for 32 sequences: 32 * 151,936 * 4 = 19,447,808
    assert logits_bytes(s, 32) == 19_447_808


def test_qwen3_30b_a3b_decode_bandwidth() -> None:
    s = shape_from_config(QWEN3_30B_A3B)
    # one token reads: attention 905,969,664 + 8 experts * 48 layers * 4,718,592
    # (1,811,939,328) = 2,717,908,992 quantisable params, plus lm_head 311,164,928, one
    # embedding row 2048, routers 12,582,912, norms 210,944 = 323,960,832 in bf16:
    # (2,717,908,992 + 323,960,832) * 2 = 6,083,739,648 bytes (vs 61 GB for all weights)
    assert decode_weight_bytes_per_token(s, "bf16") == 6_083_739_648
    # fp8: 2,717,908,992 + 323,960,832 * 2 = 3,365,830,656
    assert decode_weight_bytes_per_token(s, "fp8") == 3_365_830_656
    # uniform routing: 1 token reaches exactly top-k experts; many reach nearly all
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert expected_experts_touched(128, 8, 1000) == pytest.approx(128)


def test_qwen3_30b_a3b_on_h100_layouts() -> None:
    s = shape_from_config(QWEN3_30B_A3B)
    req = Request(concurrency=32, context=32_768, gpu="H100-80GB", dtype="bf16")
    result = plan(s, req)
    by = {(lp.layout.tp, lp.layout.ep > 1): lp for lp in result.layouts}
    # usable per GPU: 80e9 * 0.9 = 72,000,000,000
    # TP 1, no EP: weights 61,064,245,248 + prefill 373,293,056 leave 10,562,461,696 for
    # sequences at 3,221,225,472 KV + 607,744 logits each -> 3 per GPU -> ceil(32/3) = 11
    tp1 = by[(1, False)]
    assert (tp1.layout.gpus, tp1.layout.dp, tp1.fits) == (11, 11, True)
    assert tp1.kv_per_gpu == 3 * 3_221_225_472
    assert tp1.total_per_gpu == 61_064_245_248 + 9_663_676_416 + 373_293_056 + 3 * 607_744
    # TP 2, no EP, dp 1: weights (attention 905,969,664 + experts 28,991,029,248 +
    # embedding and lm_head 622,329,856) * 2 / 2 + (norms + router 12,793,856) * 2
    # = 30,519,328,768 + 25,587,712 = 30,544,916,480; KV: 32 seqs * 3 GiB / 2 = 51.5 GB
    # -> 82.9 GB > 72 GB; dp 2 halves the KV (16 seqs): 25,769,803,776 -> fits on 4 GPUs
    tp2 = by[(2, False)]
    assert tp2.weights_per_gpu == 30_544_916_480
    assert (tp2.layout.dp, tp2.layout.gpus, tp2.kv_per_gpu) == (2, 4, 25_769_803_776)
    # TP 8 over 4 KV heads: each head is on 2 GPUs, a GPU holds a quarter of the cache
    tp8 = by[(8, False)]
    assert tp8.kv_per_gpu == 32 * 3_221_225_472 // 4
    assert tp8.notes and "each head's cache is held by 2 GPUs" in tp8.notes[0]
    # 4 GPUs is the fewest; among those, TP 4 (dp 1) reads least per GPU per step
    assert result.recommended is not None
    assert (result.recommended.layout.gpus, result.recommended.layout.tp) == (4, 4)
    # TP 4: per GPU per step reads weights/4 less the embedding shard, the experts the
    # 32 tokens reach (/4) and its KV (32 seqs / 4) -> the bandwidth ceiling
    tp4 = result.recommended
    e_bytes = 4_718_592 * 2 * 48
    touched = 128 * (1 - (120 / 128) ** 32)
    read = ((905_969_664 + 311_164_928) * 2 / 4 + 12_793_856 * 2 + touched * e_bytes / 4
            + 32 * 3_221_225_472 / 4)
    assert tp4.decode_bytes_per_step == round(read)
    assert tp4.decode_tokens_s == pytest.approx(32 * 3.35e12 / read)


def test_qwen3_30b_a3b_expert_parallel() -> None:
    s = shape_from_config(QWEN3_30B_A3B)
    req = Request(concurrency=32, context=32_768, gpu="H100-80GB")
    # TP 1 with EP over 4 GPUs: attention, embeddings and lm_head whole on each GPU
    # ((905,969,664 + 622,329,856) * 2 = 3,056,599,040), norms and routers 25,587,712,
    # a quarter of the experts (28,991,029,248 * 2 / 4 = 14,495,514,624)
    lp = plan_layout(s, req, Layout(tp=1, dp=4, ep=4))
    assert lp.valid and lp.weights_per_gpu == 3_056_599_040 + 25_587_712 + 14_495_514_624
    # KV: 8 sequences per group, not split (TP 1): 8 * 3 GiB
    assert lp.kv_per_gpu == 8 * 3_221_225_472
    # 128 experts: EP 3 is refused, EP 4 and 8 are fine
    assert "does not divide the 128 experts" in plan_layout(
        s, req, Layout(tp=1, dp=3, ep=3)).reason


def test_qwen3_235b_a22b() -> None:
    s = shape_from_config(QWEN3_235B_A22B)
    p = s.params()
    # attention per layer: q 4096*8192 = 33,554,432; k, v 4096*512 = 2,097,152 each;
    # o 8192*4096 = 33,554,432 -> 71,303,168; x 94 = 6,702,497,792
    assert p.attention == 6_702_497_792
    # experts: 128 * 3 * 4096 * 1536 = 2,415,919,104 per layer; x 94 = 227,096,395,776
    assert p.experts == 227_096_395_776
    # per layer 71,303,168 + 256 (qk norms) + 8192 (norms) + 524,288 (router)
    # + 2,415,919,104 = 2,487,755,008; x 94 = 233,848,970,752; + embeddings 2 * 151,936
    # * 4096 = 1,244,659,712 + final norm 4096 = 235,093,634,560 (the card's "235B")
    assert p.total == 235_093_634_560
    # active: - 94 * 120 * 18,874,368 = 212,902,871,040 -> 22,190,763,520 ("22B")
    assert s.active_params() == 22_190_763_520
    # KV per token: 94 * 2 * 4 * 128 * 2 = 192,512 bytes
    assert kv_bytes_per_token(s) == 192_512
    # bf16 weights 470 GB do not fit one 8-GPU H100 node at 32 x 32k (KV 201.9 GB more)
    result = plan(s, Request(concurrency=32, context=32_768, gpu="H100-80GB"))
    assert result.recommended is not None and result.recommended.layout.gpus > 8
    # 64 heads and 4 KV heads: TP 8 is valid (KV replicated), TP 3 would not be
    assert tp_problem(s, 8, False) == ""
    assert "does not divide the 64 attention heads" in tp_problem(s, 3, False)


def test_qwen3_8b_dense() -> None:
    s = shape_from_config(QWEN3_8B)
    p = s.params()
    assert s.moe is None and p.experts == 0
    # per layer: attention 4096*4096*2 + 4096*1024*2 = 41,943,040; MLP 3*4096*12288 =
    # 150,994,944; norms 8192 + 256 -> 192,946,432; x 36 = 6,946,071,552; + embeddings
    # 1,244,659,712 + 4096 = 8,190,735,360 (the card's "8.2B")
    assert p.total == 8_190_735_360
    assert s.active_params() == p.total
    # KV: 36 * 2 * 8 * 128 * 2 = 147,456 bytes per token
    assert kv_bytes_per_token(s) == 147_456
    # a dense token reads every weight but the embedding table (less one row):
    # (8,190,735,360 - 622,329,856 + 4096) * 2
    assert decode_weight_bytes_per_token(s, "bf16") == (8_190_735_360 - 622_329_856
                                                        + 4096) * 2
    # 8 concurrent 8k sequences on one H200: 16.4 GB weights + 9.7 GB KV fit one GPU
    result = plan(s, Request(concurrency=8, context=8192, gpu="H200-141GB"))
    assert result.recommended is not None and result.recommended.layout.gpus == 1
    # TP 16 is not tried (one node); TP 8 splits 8 KV heads one each
    assert [lp.layout.tp for lp in result.layouts] == [1, 2, 4, 8]


def test_sliding_window_layers_cap_their_cache() -> None:
    # Mistral-style: every layer slides over 4096 tokens
    cfg = {**QWEN3_8B, "model_type": "mistral", "sliding_window": 4096,
           "use_sliding_window": True}
    s = shape_from_config(cfg)
    assert kv_bytes_per_sequence(s, 32_768) == 4096 * 147_456
    assert kv_bytes_per_sequence(s, 1000) == 1000 * 147_456
    # Qwen-style: layers from max_window_layers (30) on slide; 6 of 36 layers
    s2 = shape_from_config({**QWEN3_8B, "sliding_window": 4096, "use_sliding_window": True,
                            "max_window_layers": 30})
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_per_sequence(s2, 32_768) == per_layer * (30 * 32_768 + 6 * 4096)
    # explicit layer_types win; use_sliding_window false turns windows off
    types = ["sliding_attention", "full_attention"] * 18
    s3 = shape_from_config({**QWEN3_8B, "sliding_window": 1024, "layer_types": types})
    assert kv_bytes_per_sequence(s3, 8192) == per_layer * (18 * 1024 + 18 * 8192)
    s4 = shape_from_config({**QWEN3_8B, "sliding_window": 4096, "use_sliding_window": False})
    assert kv_bytes_per_sequence(s4, 8192) == 8192 * 147_456


def test_published_totals_of_the_other_presets() -> None:
    def billions(name: str) -> tuple[float, float]:
        s = shape_from_config(PRESETS[name])
        return round(s.params().total / 1e9, 1), round(s.active_params() / 1e9, 1)

    assert billions("llama-3.1-8b") == (8.0, 8.0)
    assert billions("llama-3.1-70b") == (70.6, 70.6)
    assert billions("mixtral-8x7b") == (46.7, 12.9)
    assert billions("deepseek-v3") == (671.0, 37.6)
    # DeepSeek-V3's MLA caches 512 + 64 elements per token and layer: 61 * 576 * 2 bytes
    s = shape_from_config(PRESETS["deepseek-v3"])
    assert kv_bytes_per_token(s) == 61 * 576 * 2 == 70_272
    assert s.num_moe_layers == 58  # first_k_dense_replace = 3


@pytest.mark.parametrize(("patch", "field", "words"), [
    ({"hidden_size": None}, "hidden_size", "config.hidden_size is missing"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", "out of range"),
    ({"num_key_value_heads": 5}, "num_key_value_heads", "not a multiple"),
    ({"vocab_size": "big"}, "vocab_size", "whole number"),
    ({"hidden_size": True}, "hidden_size", "whole number"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok", "exceeds"),
    ({"moe_intermediate_size": None, "intermediate_size": None}, "moe_intermediate_size",
     "cannot size the experts"),
    ({"layer_types": ["full_attention"]}, "layer_types", "one attention type per layer"),
])
def test_bad_configs_name_the_key(patch: dict, field: str, words: str) -> None:
    cfg = {k: v for k, v in {**QWEN3_30B_A3B, **patch}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        shape_from_config(cfg)
    assert err.value.field == field
    assert words in err.value.message


def test_request_bounds() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Request(concurrency=0, context=10)
    with pytest.raises(ValueError, match="gpu must be one of"):
        Request(concurrency=1, context=10, gpu="TPU")
    with pytest.raises(ValueError, match="headroom"):
        Request(concurrency=1, context=10, headroom=1.0)


def test_nothing_fits_says_so() -> None:
    s = shape_from_config(QWEN3_235B_A22B)
    result = plan(s, Request(concurrency=1, context=1024, gpu="L40S-48GB", max_gpus=4))
    assert result.recommended is None
    assert any("no layout of up to 4 L40S-48GB GPUs" in w for w in result.warnings)
    assert plan(s, Request(concurrency=1, context=100_000)).warnings[0].startswith(
        "context 100000 exceeds the model's max_position_embeddings 40960")
