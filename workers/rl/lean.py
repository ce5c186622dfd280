"""A lean, no-grad forward of Qwen3-MoE for the HF rollout backend's decode loop.

On the tiny models the engine trains on CPU, a transformers forward costs about 2 ms whatever the
batch (64 tokens or 8): output recorders, mask construction, a growing `DynamicCache`, three
projections, two norms and two RoPE rounds per attention, each a handful of small ops. Sampling
runs that forward once per generated token, so it sets the rollout's speed. This module runs the
same mathematics on the policy's own parameters, read at the start of each generate call (so it
samples from the current weights): preallocated K/V buffers, one additive mask per forward, q/k/v
as one projection, q/k norms and RoPE applied to q and k together, grouped-query attention as
two matmuls, fused RMSNorm; the MoE experts are the model's own implementation.

It is used only where it is exact up to float rounding: a plain (not ZeRO-3 partitioned) fp32
`Qwen3MoeForCausalLM` with default RoPE, no attention bias, no sliding window and MoE in every
layer. Anything else samples through transformers as before (`lean_decoder` returns None).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from workers.rl.balance import BIAS, biased_topk, select
from workers.rl.routing import NO_ROUTE, ROUTE_DTYPE, force_routes


def supported(model: torch.nn.Module) -> bool:
    """Whether `LeanQwen3Moe` computes exactly what `model.forward` does."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "qwen3_moe":
        return False
    if hasattr(model, "peft_config") and not lora_foldable(model):
        return False
    if getattr(model, "use_kernels", False):
        return False
    if any(type(m).__name__ == "ExpertParallelMoeBlock" for m in model.modules()):
        return False  # experts sharded over ranks: their tokens travel by all-to-all
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return False
    if (cfg.attention_bias or cfg.hidden_act != "silu" or list(cfg.mlp_only_layers)
            or cfg.decoder_sparse_step != 1 or not cfg.num_experts
            or getattr(cfg, "sliding_window", None) is not None):
        return False
    modules, params = _members(model)
    if foreign_hooks(modules):
        return False
    if any(getattr(m, "int8_weights", False) for m in modules):
        return False  # int8 serving (workers.inference.quantize): no float weights to fuse
    # Under ZeRO-3 a partitioned parameter is an empty local tensor carrying a ds_status.
    return all(p.dtype == torch.float32 and not hasattr(p, "ds_status") and p.numel() > 0
               for p in params)


_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lora_foldable(model: Any) -> bool:
    """A peft LoRA model whose adapters `_weight` can fold into the fused projections: no
    dropout (the fold has no per-token mask) and adapters switched on."""
    from workers.rl.lora import is_lora

    if not is_lora(model):
        return False
    layers: list[Any] = [m for m in _members(model)[0]
                         if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    return all(not m.disable_adapters and all(
        isinstance(d, torch.nn.Identity) for d in m.lora_dropout.values()) for m in layers)


def _weight(linear: Any) -> torch.Tensor:
    """A Linear's weight; for a peft LoRA layer base + B·A·scale of its active adapters, a
    differentiable function of A and B, so the fused projections carry the adapter (equal to
    peft's forward up to float rounding: x(W + sBA)ᵀ against xWᵀ + s(xAᵀ)Bᵀ)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    w = base.weight
    for name in linear.active_adapters:
        if name in linear.lora_A:
            w = w + linear.get_delta_weight(name)
    return w


def _members(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.Tensor]]:
    """The model's modules and parameters as lists, walked once per model: `supported` runs
    on every generate call and training forward, and the recursive walks cost ~0.1 ms."""
    if model not in _MEMBERS:
        _MEMBERS[model] = (list(model.modules()), list(model.parameters()))
    return _MEMBERS[model]


def foreign_hooks(modules: list[torch.nn.Module]) -> bool:
    """Forward hooks (instrumentation, adapters, ZeRO-3's parameter gathering) run only inside
    the model's own forward, so any of them rules the lean forward out. Exempt: the DeepSpeed
    engine's own prologue/epilogue on the root module (timers, a profiler, ZeRO-3 flags and fp16
    input casting, none of which applies to an unpartitioned fp32 model), and transformers'
    output-capturing hooks, installed by the model's first own forward (a LoRA policy's
    adapters-off reference pass, say): they record only while that forward has a collector
    open, so outside it they do nothing."""
    for m in modules:
        if not (m._forward_hooks or m._forward_pre_hooks):
            continue
        for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()):
            if getattr(hook, "lean_safe", False):  # balance.bias_hook: applied in `moe`
                continue
            name = getattr(hook, "__qualname__", "")
            if not name.startswith(("DeepSpeedEngine.", "install_output_capuring_hook.")):
                return True
    return False


class LeanQwen3Moe:
    """Prefill once, then one `step` per generated token, for a fixed batch of B rows.

    `prefill(ids, mask, rows)` runs the distinct prompts (left-padded, (U,P)) and copies their
    keys/values to the B rows that share them (`rows`: (B,) index into U); both return the
    next-token logits (B,V) of every row.
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int):
        # A Hugging Face module tree: torch types its config and submodules, read as
        # attributes, as `Tensor | Module`, so they are read through Any here.
        wrapped: Any = model  # a peft wrapper, or the model itself
        hf: Any = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else model
        cfg = hf.config
        self.model = model
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps, self.top_k = cfg.rms_norm_eps, cfg.num_experts_per_tok
        self.norm_topk = cfg.norm_topk_prob
        inner = hf.model
        self.layers: list[Any] = list(inner.layers[: cfg.num_hidden_layers])
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, hf.lm_head
        weight = inner.embed_tokens.weight
        # transformers' grouped_mm experts, inlined for CPU (see grouped_experts).
        self.grouped = (getattr(cfg, "_experts_implementation", None) == "grouped_mm"
                        and weight.device.type == "cpu"
                        and hasattr(torch.nn.functional, "grouped_mm"))
        device, dtype = weight.device, weight.dtype
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv
        # Per layer, built once per generate call from the current weights: q/k/v as one
        # projection, and one (H+KV, hd) scale for q_norm and k_norm with the attention's
        # 1/sqrt(hd) folded into the query half (RoPE is linear, so it commutes).
        self.qkv: list[torch.Tensor] = []
        self.o: list[torch.Tensor] = []
        self.qk_scale: list[torch.Tensor] = []
        for layer in self.layers:
            att = layer.self_attn
            self.qkv.append(torch.cat([_weight(att.q_proj), _weight(att.k_proj),
                                       _weight(att.v_proj)]))
            self.o.append(_weight(att.o_proj))
            self.qk_scale.append(torch.cat([
                (att.q_norm.weight * hd**-0.5).expand(h, hd),
                att.k_norm.weight.expand(kv, hd)]))
        # cos/sin for every position this batch can reach, from the model's own rotary module;
        # rotate_half(x) * sin == roll(x, hd/2) * (sin with its first half negated).
        positions = torch.arange(max_len, device=device).unsqueeze(0)
        cos, sin = inner.rotary_emb(weight[:1], positions)
        sign = torch.ones(hd, dtype=dtype, device=device)
        sign[: hd // 2] = -1.0
        self.cos, self.sin = cos[0], sin[0] * sign  # (T,hd)
        self.neg = torch.finfo(dtype).min
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        if batch:  # the decode loop's K/V buffers, one allocation for all layers. Not
            # zeroed: a forward reads cache positions [0, at+T) only, every one of them
            # written first (prefill fills [0, P) of every row, each step its own position).
            kv_all = torch.empty((2, len(self.layers), batch, kv, max_len, hd), dtype=dtype,
                                 device=device)
            self.keys, self.values = list(kv_all[0].unbind()), list(kv_all[1].unbind())
        self.key_ok = torch.ones((batch, max_len), dtype=torch.bool, device=device)
        self.length = 0  # filled cache positions
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.used: list[torch.Tensor] = []  # per layer, the expert indices of this forward
        self.forced: torch.Tensor | None = None  # router replay: ((N*T),L,k) routes to use
        self.routes: torch.Tensor | None = None  # a training forward's routes, padded layout

    # ---- building blocks -------------------------------------------------------------------

    def rms(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, self.eps)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  bias: torch.Tensor, cache_rows: torch.Tensor | None, at: int) -> torch.Tensor:
        """Layer i's self-attention, x (N,T,D) -> (N,T,D). New keys/values go to cache
        positions [at, at+T) of the rows `cache_rows` (None: rows 0..N-1); queries attend to
        positions [0, at+T)."""
        n, t, _ = x.shape
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv
        g = h // kv
        # `split`, not two slices: the same views forward, and backward one cat of the parts'
        # gradients instead of a zero-filled full-size gradient per slice, summed.
        qk, v = F.linear(x, self.qkv[i]).view(n, t, h + 2 * kv, hd).split([h + kv, kv], 2)
        qk = F.rms_norm(qk, (hd,), None, self.eps) * self.qk_scale[i]
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # RoPE, (N,T,H+KV,hd)
        q, k = (part.transpose(1, 2) for part in qk.split([h, kv], 2))  # (N,H|KV,T,hd)
        v = v.transpose(1, 2)
        if not self.keys:  # training: no cache, the whole sequence at once
            keys, values = k, v
        elif cache_rows is None:
            self.keys[i][:, :, at : at + t] = k
            self.values[i][:, :, at : at + t] = v
            keys, values = self.keys[i][:, :, : at + t], self.values[i][:, :, : at + t]
        else:  # prefill of distinct prompts: attend within them, then fan out to the rows
            self.keys[i][:, :, at : at + t] = k[cache_rows]
            self.values[i][:, :, at : at + t] = v[cache_rows]
            keys, values = k, v
        # Query head j reads key head j // g: group the g query heads of each key head.
        q = q.reshape(n, kv, g * t, hd)
        scores = torch.matmul(q, keys.transpose(-1, -2))  # (N,KV,g*T,S)
        scores = (scores.view(n, kv, g, t, -1) + bias).softmax(-1)
        out = torch.matmul(scores.view(n, kv, g * t, -1), values)  # (N,KV,g*T,hd)
        out = out.view(n, h, t, hd).transpose(1, 2).reshape(n, t, h * hd)
        return F.linear(out, self.o[i])

    def moe(self, layer: Any, x: torch.Tensor,
            routers: list[torch.Tensor] | None = None, i: int = 0) -> torch.Tensor:
        """Top-k routed experts, as Qwen3MoeSparseMoeBlock. x (N,T,D). The router logits
        ((N*T),E) are appended to `routers` when given; the expert indices used ((N*T),k) to
        `self.used`, in the order the layers run. Under router replay (`self.forced`,
        ((N*T),L,k)) layer i takes its expert choice from `forced[:, i]`, its weights from its
        own router logits (`routing.force_routes`)."""
        block = layer.mlp
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = F.linear(h, block.gate.weight)
        if routers is not None:
            routers.append(logits)
        bias = getattr(block.gate, BIAS, None)  # aux-free balancing: selection only
        if self.forced is None and bias is None:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                top = top / top.sum(dim=-1, keepdim=True)
            top = top.to(h.dtype)
        elif self.forced is None:
            top, idx = biased_topk(logits, bias, self.top_k, self.norm_topk)
        else:
            own = select(logits.detach().float().softmax(-1), self.top_k, bias)
            top, idx = force_routes(logits, own, self.forced[:, i], self.norm_topk)
        self.used.append(idx)
        if self.grouped:
            return grouped_experts(block.experts, h, idx, top).view(shape)
        # The model's own experts implementation.
        return block.experts(h, idx, top).view(shape)

    def take_routes(self) -> torch.Tensor:
        """The expert indices of the forward just run, ((N*T),L,k) in layer order, as
        `ROUTE_DTYPE`; clears them for the next forward."""
        out = torch.stack(self.used, 1).to(ROUTE_DTYPE)
        self.used = []
        return out

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor,
                cache_rows: torch.Tensor | None, at: int) -> torch.Tensor:
        """Logits (N,V) at the last position of each row of ids (N,T)."""
        x = self.embed(ids)
        cos = self.cos[pos].unsqueeze(2)  # (N,T,1,hd)
        sin = self.sin[pos].unsqueeze(2)
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, self.rms(x, layer.input_layernorm), cos, sin, bias,
                                   cache_rows, at)
            x = x + self.moe(layer, self.rms(x, layer.post_attention_layernorm), None, i)
        return self.lm_head(self.rms(x[:, -1], self.norm))

    # ---- training -----------------------------------------------------------------------

    def train_forward(self, ids: torch.Tensor, mask: torch.Tensor,
                      routes: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The model's forward with autograd over whole sequences (B,L), padded anywhere:
        logits (B,L,V) at every position and each layer's router logits ((B*L),E).
        `routes` (B,L,layers,k): router replay's expert choice per token (NO_ROUTE: the
        router's own); the routes used are left in `self.routes` (B,L,layers,k)."""
        b, length = ids.shape
        self.used = []
        self.forced = None if routes is None else routes.reshape(b * length,
                                                                 *routes.shape[2:])
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((length, length), dtype=torch.bool, device=ids.device).tril()
        allowed = causal.unsqueeze(0) & mask.bool().unsqueeze(1)  # (B,L,L)
        bias = torch.zeros(allowed.shape, dtype=self.cos.dtype, device=ids.device)
        bias = bias.masked_fill_(~allowed, self.neg).view(b, 1, 1, length, length)
        x = self.embed(ids)
        cos = self.cos[pos].unsqueeze(2)
        sin = self.sin[pos].unsqueeze(2)
        routers: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, self.rms(x, layer.input_layernorm), cos, sin, bias,
                                   None, 0)
            x = x + self.moe(layer, self.rms(x, layer.post_attention_layernorm), routers, i)
        self.forced = None
        self.routes = self.take_routes().view(b, length, len(self.layers), self.top_k)
        return self.lm_head(self.rms(x, self.norm)), tuple(routers)

    def train_forward_packed(
        self, p_ids: torch.Tensor, p_mask: torch.Tensor, c_ids: torch.Tensor,
        c_mask: torch.Tensor, p_routes: torch.Tensor | None = None,
        c_routes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor] | None:
        """The training forward over prompt (B,P, left-padded) + completion (B,C, right-padded)
        rows, packed: each distinct prompt's real tokens once, then every row's real completion
        tokens, as one sequence whose attention mask gives each token exactly the keys it has in
        its own row (its prompt, then its row's earlier completion tokens), at the same
        positions. GRPO repeats every prompt `group_size` times and pads completions to the
        longest, so this is a fraction of B x (P+C) tokens; the mathematics is the unpacked
        forward's. Returns completion logits (B,C,V) (position t predicts completion token t;
        at padded positions a copy of a real one), per-layer router logits (T,E) of the packed
        tokens and their weights (T,): the number of rows each token stands for, so weighted
        router statistics equal the unpacked masked ones. None when no prompt is shared, or
        when the packed sequence's T x T attention would cost much more than the padded rows'
        B x L x L (long sequences): then the padded forward is the one to run.

        Router replay: `p_routes` (B,P,layers,k) and `c_routes` (B,C,layers,k) give each
        token's expert choice (both or neither). Rows share a packed prompt only when their
        prompt routes agree too, so every row's recorded prompt routes are the ones used. The
        routes used are left in `self.routes` in the padded layout (B,P+C,layers,k),
        NO_ROUTE on padding."""
        b, p = p_ids.shape
        dev = p_ids.device
        key = [p_ids, p_mask.long()]
        if p_routes is not None:
            key.append(p_routes.reshape(b, -1).long())
        uniq, inverse = torch.unique(torch.cat(key, 1), dim=0, return_inverse=True)
        u = uniq.shape[0]
        if u == b:
            return None
        u_ids, u_ok = uniq[:, :p], uniq[:, p:2 * p].bool()
        u_pos = (u_ok.long().cumsum(-1) - 1).clamp(min=0)
        c_ok = c_mask.bool()
        n_prompt = u_ok.sum(-1)  # (U,) real prompt tokens
        c_pos = n_prompt[inverse].unsqueeze(1) + torch.arange(c_ids.shape[1], device=dev)
        owner_p = torch.arange(u, device=dev).unsqueeze(1).expand(u, p)[u_ok]
        row_c = torch.arange(b, device=dev).unsqueeze(1).expand_as(c_ids)[c_ok]
        n_p = owner_p.shape[0]
        ids = torch.cat([u_ids[u_ok], c_ids[c_ok]])  # (T,)
        t, length = ids.shape[0], p + c_ids.shape[1]
        if t * t > max(1 << 20, 4 * b * length * length):
            return None
        pos = torch.cat([u_pos[u_ok], c_pos[c_ok]])
        group = torch.cat([owner_p, inverse[row_c]])
        row = torch.cat([torch.full((n_p,), -1, device=dev), row_c])
        is_prompt = row < 0
        allowed = ((group[:, None] == group[None, :]) & (pos[None, :] <= pos[:, None])
                   & (is_prompt[None, :] | (row[None, :] == row[:, None])))  # (T,T)
        bias = torch.zeros((t, t), dtype=self.cos.dtype, device=dev)
        bias = bias.masked_fill_(~allowed, self.neg).view(1, 1, 1, t, t)
        x = self.embed(ids).unsqueeze(0)  # (1,T,D)
        cos = self.cos[pos].view(1, t, 1, -1)
        sin = self.sin[pos].view(1, t, 1, -1)
        n_layers, k = len(self.layers), self.top_k
        self.used = []
        self.forced = None
        if p_routes is not None and c_routes is not None:
            u_routes = uniq[:, 2 * p:].view(u, p, n_layers, k)
            self.forced = torch.cat([u_routes[u_ok], c_routes.to(dev)[c_ok].long()])
        routers: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, self.rms(x, layer.input_layernorm), cos, sin, bias,
                                   None, 0)
            x = x + self.moe(layer, self.rms(x, layer.post_attention_layernorm), routers, i)
        self.forced = None
        used = self.take_routes()  # (T,layers,k), unpacked to the padded layout:
        u_used = torch.full((u, p, n_layers, k), NO_ROUTE, dtype=used.dtype, device=dev)
        u_used[u_ok] = used[:n_p]
        c_used = torch.full((*c_ids.shape, n_layers, k), NO_ROUTE, dtype=used.dtype,
                            device=dev)
        c_used[c_ok] = used[n_p:]
        self.routes = torch.cat([u_used[inverse], c_used], 1)
        # Which packed token predicts completion token (r, c): the prompt's last real token for
        # c = 0, the row's token c-1 after that (a real one stands in at padded positions).
        last_prompt = torch.cumsum(u_ok.sum(-1), 0) - 1  # (U,) index of each prompt's last
        comp_index = torch.full(c_ids.shape, -1, dtype=torch.long, device=dev)
        comp_index[c_ok] = torch.arange(n_p, t, device=dev)
        pred = torch.cat([last_prompt[inverse].unsqueeze(1), comp_index[:, :-1]], 1)
        pred = torch.where(pred < 0, pred[:, :1], pred)
        logits = self.lm_head(self.rms(x[0, pred], self.norm))  # (B,C,V)
        weights = torch.cat([torch.bincount(inverse, minlength=u)[owner_p],
                             torch.ones(t - n_p, dtype=torch.long, device=dev)])
        return logits, tuple(routers), weights.to(x.dtype)

    # ---- the decode loop's calls -----------------------------------------------------------

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids/mask (U,P) left-padded distinct prompts; rows (B,). Returns logits (B,V)."""
        u, p = ids.shape
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        ok = mask.bool()
        self.key_ok[:, :p] = ok[rows]
        causal = torch.ones((p, p), dtype=torch.bool, device=ids.device).tril()
        allowed = causal.unsqueeze(0) & ok.unsqueeze(1)  # (U,P,P)
        bias = torch.zeros(allowed.shape, dtype=self.cos.dtype, device=ids.device)
        bias.masked_fill_(~allowed, self.neg)
        logits = self.forward(ids, pos, bias.view(u, 1, 1, p, p), rows, 0)
        self.length = p
        self.pos = pos[rows, -1:]
        return logits[rows]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,1): the token each row sampled last. Returns logits (B,V)."""
        self.pos = self.pos + 1
        at = self.length
        n = tokens.shape[0]
        ok = self.key_ok[:, : at + 1]
        bias = torch.zeros(ok.shape, dtype=self.cos.dtype, device=tokens.device)
        bias.masked_fill_(~ok, self.neg)
        logits = self.forward(tokens, self.pos, bias.view(n, 1, 1, 1, at + 1), None, at)
        self.length = at + 1
        return logits


def grouped_experts(experts: Any, h: torch.Tensor, idx: torch.Tensor,
                    top: torch.Tensor) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` for Qwen3-MoE experts on CPU, bit for bit,
    without its per-call dispatch checks: (token, expert) pairs sorted by expert, one grouped
    matmul up, SiLU gate, one down, weighted, summed per token (for k <= 2 added straight into
    place, no un-permuting). h (N,D), idx/top (N,k)."""
    k = idx.shape[-1]
    expert_ids, perm = torch.sort(idx.reshape(-1))
    token = perm // k
    hidden = h[token]
    weights = top.reshape(-1)[perm]
    # Integer counts per expert, as transformers' histc of the float ids counts them.
    offsets = torch.bincount(expert_ids, minlength=experts.num_experts).cumsum(
        0, dtype=torch.int32)
    up = F.grouped_mm(hidden, experts.gate_up_proj.transpose(-2, -1), offs=offsets)
    gate, up = up.chunk(2, dim=-1)
    out = F.grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1),
                       offs=offsets)
    out = out * weights.unsqueeze(-1)
    if k <= 2:
        # Each token's k <= 2 contributions added into zeros: 0 + a + b equals transformers'
        # a + b in either order (float addition commutes), so bit for bit, in fewer ops
        # forward and backward than un-permuting and summing.
        return torch.zeros_like(h).index_add_(0, token, out)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(h.shape[0], k, h.shape[-1]).sum(dim=1)


def lean_decoder(model: torch.nn.Module, batch: int, max_len: int) -> LeanQwen3Moe | None:
    return LeanQwen3Moe(model, batch, max_len) if supported(model) else None
