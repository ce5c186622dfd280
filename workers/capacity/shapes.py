"""A model's shape, read from its Hugging Face ``config.json``, and its parameters counted
by kind, so the planner can price each kind at its own dtype (quantised linear layers,
bf16 embeddings, norms and routers) and tell the experts a token reads from the rest.

Supported: dense Llama / Qwen2 / Qwen3 / Mistral, Qwen2-MoE / Qwen3-MoE (``num_experts``,
``mlp_only_layers``, ``decoder_sparse_step``, a shared expert), Mixtral
(``num_local_experts``) and DeepSeek-V2/V3 (``n_routed_experts``, ``n_shared_experts``,
``first_k_dense_replace``, multi-head latent attention). Counts assume bias-free SwiGLU MLPs
(three matrices) and RMSNorm, which all of these use. Pure Python: no torch, no
transformers, so the control plane can call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Bounds that keep arithmetic on hostile input cheap and the errors readable; every real
#: model is far inside them.
MAX_DIM = 1 << 20
MAX_LAYERS = 10_000
MAX_EXPERTS = 100_000
MAX_VOCAB = 1 << 24

QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})  # RMSNorm over q and k, head_dim each
QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})  # q, k, v projections carry a bias


class ConfigError(ValueError):
    """A config the planner cannot read; ``field`` names the key to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _int(cfg: Mapping[str, Any], key: str, *, upper: int, default: int | None = None,
         minimum: int = 1) -> int:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(key, f"config.{key} is missing: the planner needs it (a positive "
                               "whole number, as in the model's config.json).")
    # bool is an int in Python; a config with "hidden_size": true is a typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(key, f"config.{key} must be a whole number, not "
                                   f"{str(value)[:40]!r}.")
    if value < minimum or value > upper:
        raise ConfigError(key, f"config.{key} = {value} is out of range: it must be between "
                               f"{minimum} and {upper}.")
    return value


def _opt_int(cfg: Mapping[str, Any], key: str, *, upper: int, minimum: int = 1) -> int | None:
    return None if cfg.get(key) is None else _int(cfg, key, upper=upper, minimum=minimum)


def _bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(key, f"config.{key} must be true or false, not {str(value)[:40]!r}.")
    return value


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention: the cache holds one compressed latent
    (``kv_lora_rank``) plus the shared rotary key (``qk_rope_head_dim``) per token and layer."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Moe:
    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    #: Width of the always-on shared expert MLP (0: none), and whether a sigmoid gate
    #: (Qwen2-MoE's ``shared_expert_gate``, one H-vector) scales it.
    shared_intermediate: int
    shared_gate: bool


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by kind. ``quantisable`` kinds are the linear layers a weight-only or fp8
    checkpoint stores at the lower precision; the rest stay bf16 in such checkpoints."""

    embedding: int  # input embedding table (V x H)
    lm_head: int  # output projection (0 when tied to the embedding)
    attention: int  # q/k/v/o (or MLA) projections, all layers
    dense_mlp: int  # SwiGLU MLPs of dense layers
    experts: int  # routed experts, all MoE layers
    shared_experts: int  # shared experts, all MoE layers
    router: int  # router (and shared-expert gate) weights
    norms: int  # RMSNorm weights and biases

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp
                + self.experts + self.shared_experts + self.router + self.norms)

    @property
    def quantisable(self) -> int:
        return self.attention + self.dense_mlp + self.experts + self.shared_experts

    @property
    def kept_bf16(self) -> int:
        return self.total - self.quantisable


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model, whatever the config's spelling."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    intermediate_size: int  # dense MLP width (0 when no layer is dense)
    moe: Moe | None
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    #: Per layer: the window it attends over (None: full attention).
    windows: tuple[int | None, ...]
    mla: Mla | None
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    max_position_embeddings: int | None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def kv_elements_per_token_layer(self) -> int:
        """Cached elements per token in one layer: K and V of every KV head, or MLA's latent
        plus its rotary key."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def attention_params_per_layer(self) -> tuple[int, int]:
        """(projection weights, norm and bias parameters) of one attention block."""
        h, a = self.hidden_size, self.num_heads
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                q = h * m.q_lora_rank + m.q_lora_rank * a * qk
                q_norm = m.q_lora_rank
            else:
                q, q_norm = h * a * qk, 0
            kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv_b = m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
            o = a * m.v_head_dim * h
            return q + kv_a + kv_b + o, q_norm + m.kv_lora_rank
        k, d = self.num_kv_heads, self.head_dim
        weights = h * a * d + 2 * h * k * d + a * d * h
        extra = (a * d + 2 * k * d if self.qkv_bias else 0) + (h if self.o_bias else 0)
        extra += 2 * d if self.qk_norm else 0
        return weights, extra

    def params(self) -> ParamCounts:
        h, n = self.hidden_size, self.num_layers
        attn, attn_extra = self.attention_params_per_layer()
        experts = shared = router = 0
        if self.moe is not None:
            m, layers = self.moe, self.num_moe_layers
            experts = layers * m.num_experts * 3 * h * m.expert_intermediate
            shared = layers * 3 * h * m.shared_intermediate
            router = layers * (h * m.num_experts + (h if m.shared_gate else 0))
        embedding = self.vocab_size * h
        return ParamCounts(
            embedding=embedding,
            lm_head=0 if self.tie_word_embeddings else embedding,
            attention=n * attn,
            dense_mlp=self.num_dense_layers * 3 * h * self.intermediate_size,
            experts=experts, shared_experts=shared, router=router,
            # two RMSNorms per layer, the final norm, and attention's own norms/biases
            norms=n * (2 * h + attn_extra) + h,
        )

    def expert_params(self) -> int:
        """One routed expert's parameters (gate, up, down)."""
        return 0 if self.moe is None else 3 * self.hidden_size * self.moe.expert_intermediate

    def active_params(self) -> int:
        """Parameters one token passes through, by the usual convention (the whole
        embedding table counted, as model cards do): everything but the routed experts it
        is not sent to."""
        p = self.params()
        if self.moe is None:
            return p.total
        idle = self.num_moe_layers * (self.moe.num_experts - self.moe.experts_per_token)
        return p.total - idle * self.expert_params()


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs (Qwen3-VL, Llava...) keep the language model under
    ``text_config``; plan for that."""
    inner = cfg.get("text_config")
    if "hidden_size" not in cfg and isinstance(inner, Mapping):
        return inner
    return cfg


def _moe(cfg: Mapping[str, Any], intermediate: int | None) -> Moe | None:
    experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if cfg.get(k)), None)
    if experts_key is None:
        return None
    num = _int(cfg, experts_key, upper=MAX_EXPERTS)
    top_k = _int(cfg, "num_experts_per_tok", upper=MAX_EXPERTS)
    if top_k > num:
        raise ConfigError("num_experts_per_tok", f"config.num_experts_per_tok = {top_k} "
                                                 f"exceeds config.{experts_key} = {num}.")
    # Mixtral has no moe_intermediate_size: its experts are intermediate_size wide.
    width = _opt_int(cfg, "moe_intermediate_size", upper=MAX_DIM) or intermediate
    if width is None:
        raise ConfigError("moe_intermediate_size", "config.moe_intermediate_size is missing "
                                                   "(and so is intermediate_size): the "
                                                   "planner cannot size the experts.")
    shared = _opt_int(cfg, "shared_expert_intermediate_size", upper=MAX_DIM, minimum=0) or 0
    gate = shared > 0
    n_shared = _opt_int(cfg, "n_shared_experts", upper=MAX_EXPERTS, minimum=0) or 0
    if n_shared:  # DeepSeek: n_shared experts of moe_intermediate_size, fused, no gate
        shared += n_shared * width
    return Moe(num_experts=num, experts_per_token=top_k, expert_intermediate=width,
               shared_intermediate=shared, shared_gate=gate)


def _moe_layers(cfg: Mapping[str, Any], layers: int, moe: Moe | None) -> tuple[bool, ...]:
    if moe is None:
        return (False,) * layers
    dense_list = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_list, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense_list):
        raise ConfigError("mlp_only_layers", "config.mlp_only_layers must be a list of layer "
                                             "indices.")
    step = _int(cfg, "decoder_sparse_step", upper=MAX_LAYERS, default=1)
    first_dense = _int(cfg, "first_k_dense_replace", upper=layers, default=0, minimum=0)
    dense = set(dense_list)
    return tuple(i >= first_dense and i not in dense and (i + 1) % step == 0
                 for i in range(layers))


def _windows(cfg: Mapping[str, Any], layers: int, model_type: str) -> tuple[int | None, ...]:
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError("layer_types", f"config.layer_types must list one attention "
                                             f"type per layer ({layers}).")
        if any(t == "sliding_attention" for t in types):
            w = _int(cfg, "sliding_window", upper=1 << 30)
            return tuple(w if t == "sliding_attention" else None for t in types)
        return (None,) * layers
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    w = _int(cfg, "sliding_window", upper=1 << 30)
    if model_type.startswith("qwen") and cfg.get("max_window_layers") is not None:
        # Qwen2/3 (transformers' config): layers from max_window_layers on slide.
        first = _int(cfg, "max_window_layers", upper=MAX_LAYERS, minimum=0)
        return tuple(w if i >= first else None for i in range(layers))
    return (w,) * layers  # Mistral / Mixtral: every layer slides


def _mla(cfg: Mapping[str, Any]) -> Mla | None:
    if cfg.get("kv_lora_rank") is None:
        return None
    return Mla(q_lora_rank=_opt_int(cfg, "q_lora_rank", upper=MAX_DIM),
               kv_lora_rank=_int(cfg, "kv_lora_rank", upper=MAX_DIM),
               qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", upper=MAX_DIM),
               qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", upper=MAX_DIM),
               v_head_dim=_int(cfg, "v_head_dim", upper=MAX_DIM))


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """Read an HF ``config.json`` dict; :class:`ConfigError` names the first key that is
    missing or wrong."""
    if not isinstance(config, Mapping):
        raise ConfigError("config", "config must be a JSON object (a model's config.json).")
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")[:64]
    hidden = _int(cfg, "hidden_size", upper=MAX_DIM)
    layers = _int(cfg, "num_hidden_layers", upper=MAX_LAYERS)
    heads = _int(cfg, "num_attention_heads", upper=MAX_DIM)
    kv_heads = _int(cfg, "num_key_value_heads", upper=MAX_DIM, default=heads)
    if heads % kv_heads:
        raise ConfigError("num_key_value_heads", f"config.num_attention_heads = {heads} is not "
                                                 f"a multiple of num_key_value_heads = "
                                                 f"{kv_heads} (grouped-query attention needs "
                                                 "it).")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError("head_dim", f"config.head_dim is missing and hidden_size {hidden} "
                                      f"is not a multiple of num_attention_heads {heads}.")
    head_dim = _int(cfg, "head_dim", upper=MAX_DIM, default=hidden // heads)
    intermediate = _opt_int(cfg, "intermediate_size", upper=MAX_DIM)
    moe = _moe(cfg, intermediate)
    moe_layers = _moe_layers(cfg, layers, moe)
    if not all(moe_layers) and intermediate is None:
        raise ConfigError("intermediate_size", "config.intermediate_size is missing: the "
                                               "dense MLP layers need it.")
    attention_bias = cfg.get("attention_bias")
    if attention_bias is not None and not isinstance(attention_bias, bool):
        raise ConfigError("attention_bias", "config.attention_bias must be true or false.")
    qkv_bias = bool(attention_bias) or (attention_bias is None and model_type in QKV_BIAS_TYPES)
    return ModelShape(
        model_type=model_type, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", upper=MAX_VOCAB),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        intermediate_size=intermediate or 0, moe=moe, moe_layers=moe_layers,
        windows=_windows(cfg, layers, model_type), mla=_mla(cfg),
        qk_norm=model_type in QK_NORM_TYPES, qkv_bias=qkv_bias,
        o_bias=bool(attention_bias),
        max_position_embeddings=_opt_int(cfg, "max_position_embeddings", upper=1 << 30),
    )
