"""The lean Qwen3-MoE sampler forward must compute what the transformers forward computes
(up to float rounding), and must step aside wherever it would not."""

import copy

import torch

from workers.rl.lean import LeanQwen3Moe, lean_decoder, supported
from workers.rl.rollout import HFRollout, position_ids
from workers.rl.spec import RolloutSpec


def hf_last_logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                    use_cache=False)
    return out.logits[:, -1]


def test_prefill_and_decode_match_the_transformers_forward(tiny_model, tokenizer):
    tiny_model.eval()
    assert supported(tiny_model)
    prompts = ["3+4=", "12+7=", "1+1=", "99+99=", "5+"]  # left padding of 0..4 tokens
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert not bool(mask.all())
    rows = torch.tensor([0, 0, 1, 2, 3, 3, 4, 1])  # rows share prompts, out of order
    n_new = 4
    new = torch.randint(3, len(tokenizer), (len(rows), n_new), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        lean = LeanQwen3Moe(tiny_model, len(rows), ids.shape[1] + n_new)
        logits = lean.prefill(ids, mask, rows)
        for t in range(n_new):
            ref_ids = torch.cat([ids[rows], new[:, :t]], 1)
            ref_mask = torch.cat([mask[rows], torch.ones((len(rows), t), dtype=mask.dtype)], 1)
            ref = hf_last_logits(tiny_model, ref_ids, ref_mask)
            assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5), t
            logits = lean.step(new[:, t : t + 1])


def test_sampler_draws_the_same_tokens_through_either_forward(tiny_model, tokenizer):
    prompts = [p for p in ["1+2=", "13+4=", "9+9="] for _ in range(4)]
    spec = RolloutSpec(max_new_tokens=5, temperature=1.3)
    lean = HFRollout(tiny_model, tokenizer).generate(prompts, spec,
                                                     torch.Generator().manual_seed(5))
    hooked = copy.deepcopy(tiny_model)
    hooked.register_forward_hook(lambda *_: None)  # a hook: the transformers forward runs
    assert not supported(hooked)
    plain = HFRollout(hooked, tokenizer).generate(prompts, spec,
                                                  torch.Generator().manual_seed(5))
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert torch.equal(lean.completion_mask, plain.completion_mask)
    assert torch.allclose(lean.logprobs, plain.logprobs, atol=1e-5)


def test_steps_aside_where_it_would_not_be_exact(tiny_model):
    assert lean_decoder(tiny_model, 2, 8) is not None
    assert lean_decoder(copy.deepcopy(tiny_model).to(torch.bfloat16), 2, 8) is None
    windowed = copy.deepcopy(tiny_model)
    windowed.config.sliding_window = 4
    assert not supported(windowed)
    partitioned = copy.deepcopy(tiny_model)
    next(partitioned.parameters()).ds_status = "NOT_AVAILABLE"  # as ZeRO-3 marks them
    assert not supported(partitioned)
    assert not supported(torch.nn.Linear(2, 2))


def test_training_forward_matches_logits_router_logits_and_gradients(tiny_model, tokenizer):
    """Left-padded prompts and right-padded completions, as the trainer lays them out."""
    from workers.rl.losses import load_balancing_loss

    enc = tokenizer(["3+4=", "12+7=", "99+99="], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    comp = torch.tensor([[5, 6, 1, 0], [7, 1, 0, 0], [8, 9, 10, 1]])
    ids = torch.cat([enc["input_ids"], comp], 1)
    mask = torch.cat([enc["attention_mask"], (comp > 0).long()], 1)
    flat = mask.reshape(-1).float()
    k = tiny_model.config.num_experts_per_tok

    def loss_of(logits, routers):
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return -(logp * mask).sum() + load_balancing_loss(routers, k, flat)

    tiny_model.train()
    out = tiny_model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                     use_cache=False, output_router_logits=True)
    loss_of(out.logits, out.router_logits).backward()
    ref = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    logits, routers = LeanQwen3Moe(tiny_model, 0, ids.shape[1]).train_forward(ids, mask)
    loss_of(logits, routers).backward()
    real = mask.bool()
    assert torch.allclose(logits[real], out.logits[real], atol=1e-5)
    assert len(routers) == len(out.router_logits)
    for mine, theirs in zip(routers, out.router_logits, strict=True):
        assert torch.allclose(mine[real.reshape(-1)], theirs[real.reshape(-1)], atol=1e-5)
    for name, p in tiny_model.named_parameters():
        assert torch.allclose(p.grad, ref[name], atol=1e-5, rtol=1e-4), name


def test_inlined_grouped_experts_are_transformers_bit_for_bit(tiny_model):
    from workers.rl.lean import grouped_experts

    block = tiny_model.model.layers[0].mlp
    assert tiny_model.config._experts_implementation == "grouped_mm"
    for n in (1, 7, 64):
        h = torch.randn(n, tiny_model.config.hidden_size, requires_grad=True)
        _, top, idx = block.gate(h)
        theirs = block.experts(h, idx, top)
        mine = grouped_experts(block.experts, h, idx, top)
        assert torch.equal(mine, theirs)
        wrt = [h, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
        g_theirs = torch.autograd.grad(theirs.square().sum(), wrt, retain_graph=True)
        g_mine = torch.autograd.grad(mine.square().sum(), wrt)
        assert all(torch.equal(a, b) for a, b in zip(g_mine, g_theirs, strict=True))
    # top-3 routes take the un-permute-and-sum path: transformers' own order of additions
    h = torch.randn(9, tiny_model.config.hidden_size)
    logits = block.gate(h)[0]
    top, idx = torch.topk(logits.softmax(-1), 3, dim=-1)
    assert torch.equal(grouped_experts(block.experts, h, idx, top),
                       block.experts(h, idx, top))


def test_packed_training_forward_equals_the_padded_one(tiny_model, tokenizer):
    """Shared prompts of different lengths (left padding), completions of different lengths
    (right padding): packed logits at real positions, the weighted auxiliary loss and expert
    counts, and every gradient equal the padded forward's."""
    from workers.rl.losses import expert_utilisation, load_balancing_loss

    enc = tokenizer(["3+4=", "12+7=", "99+99="], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    p_ids, p_mask = enc["input_ids"][rows], enc["attention_mask"][rows]
    c_ids = torch.tensor([[5, 6, 1, 0], [7, 1, 0, 0], [8, 9, 10, 1], [5, 1, 0, 0],
                          [6, 6, 6, 6], [9, 1, 0, 0]])
    c_mask = (c_ids > 0).long()
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    p, k = p_ids.shape[1], tiny_model.config.num_experts_per_tok

    def loss_of(logits, routers, weights):
        logp = torch.log_softmax(logits.float(), -1).gather(-1, c_ids.unsqueeze(-1))
        return -(logp.squeeze(-1) * c_mask).sum() + load_balancing_loss(routers, k, weights)

    lean = LeanQwen3Moe(tiny_model, 0, ids.shape[1])
    logits, routers = lean.train_forward(ids, mask)
    padded = (logits[:, p - 1 : -1], routers, mask.reshape(-1).float())
    loss_of(*padded).backward()
    ref = {n: q.grad.clone() for n, q in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    lean = LeanQwen3Moe(tiny_model, 0, ids.shape[1])  # its fused weights are in the graph
    packed = lean.train_forward_packed(p_ids, p_mask, c_ids, c_mask)
    assert packed is not None
    assert packed[2].shape[0] == int(enc["attention_mask"].sum()) + int(c_mask.sum())
    loss_of(*packed).backward()
    real = c_mask.bool()
    assert torch.allclose(packed[0][real], padded[0][real], atol=1e-5)
    assert torch.allclose(load_balancing_loss(packed[1], k, packed[2]),
                          load_balancing_loss(padded[1], k, padded[2]), atol=1e-6)
    counts = [u["tokens"] for u in expert_utilisation(packed[1], k, packed[2])]
    assert counts == [u["tokens"] for u in expert_utilisation(padded[1], k, padded[2])]
    for name, q in tiny_model.named_parameters():
        assert torch.allclose(q.grad, ref[name], atol=1e-5, rtol=1e-4), name
    # Nothing shared: the padded forward runs instead.
    assert lean.train_forward_packed(p_ids[:3:2], p_mask[:3:2], c_ids[:3:2],
                                     c_mask[:3:2]) is None
    # Many long rows: the packed T x T attention would dwarf the padded rows' B x L x L.
    many = torch.tensor([[3, 4, 5, 6], [4, 5, 6, 7]]).repeat(32, 1)
    long_c = torch.full((64, 100), 5)
    assert lean.train_forward_packed(many, torch.ones_like(many), long_c,
                                     torch.ones_like(long_c)) is None


def test_inference_mode_sampling_is_bit_identical_and_feeds_autograd(tiny_model, tokenizer):
    """The lean decode loop runs under inference mode: the same tokens, logprobs and routes,
    to the bit, as the same loop under no_grad, and outputs the trainer's autograd can use."""
    prompts = [p for p in ["1+2=", "13+4=", "9+9="] for _ in range(4)]
    spec = RolloutSpec(max_new_tokens=5, temperature=1.3)
    backend = HFRollout(tiny_model, tokenizer)
    batch = backend.generate(prompts, spec, torch.Generator().manual_seed(5))
    ids, mask, rows = backend.encode(prompts)
    with torch.no_grad():
        lean = lean_decoder(tiny_model, len(prompts), ids.shape[1] + spec.max_new_tokens)
        ref = backend.decode(ids, mask, rows, spec, torch.Generator().manual_seed(5), None,
                             None, lean, None)
    assert torch.equal(batch.completion_ids, ref[0])
    assert torch.equal(batch.logprobs, ref[1])
    assert torch.equal(batch.completion_mask, ref[2])
    assert ref[3] is not None and batch.prompt_routes is not None
    assert torch.equal(batch.prompt_routes, ref[3][0])
    assert torch.equal(batch.completion_routes, ref[3][1])
    for t in (batch.completion_ids, batch.logprobs, batch.completion_mask,
              batch.prompt_routes, batch.completion_routes):
        assert not t.is_inference()
    w = torch.zeros(batch.logprobs.shape, requires_grad=True)
    (torch.exp(w - batch.logprobs) * batch.completion_mask).sum().backward()
    assert w.grad is not None
