"""The fast HF sampler (preallocated buffers, no wasted forward, shared prompt prefill,
deduplicated tokenization) must sample exactly what a plain, cache-free loop samples."""

import torch

from workers.rl.rollout import HFRollout, cut_at_stop, position_ids, top_p_filter
from workers.rl.spec import RolloutSpec


def reference_sample(model, tok, prompts, spec, generator):
    """Re-runs the whole sequence every token (no KV cache), one row decoded at a time."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    toks, lps, masks = [], [], []
    model.eval()
    with torch.no_grad():
        for _ in range(spec.max_new_tokens):
            logits = model(input_ids=ids, attention_mask=attn,
                           position_ids=position_ids(attn)).logits[:, -1]
            logp = torch.log_softmax(logits.float() / spec.temperature, -1)
            nxt = torch.multinomial(top_p_filter(logp.exp(), spec.top_p), 1,
                                    generator=generator).squeeze(-1)
            nxt = torch.where(done, tok.pad_token_id, nxt)
            toks.append(nxt)
            lps.append(torch.where(done, 0.0, logp.gather(-1, nxt[:, None]).squeeze(-1)))
            masks.append((~done).long())
            done = done | (nxt == tok.eos_token_id)
            for i in range(len(prompts)):
                text = tok.decode(torch.stack(toks, 1)[i], skip_special_tokens=True)
                if not done[i] and spec.stop and cut_at_stop(text, spec.stop)[1]:
                    done[i] = True
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    return torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(masks, 1)


def count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fast_sampler_matches_cache_free_reference(tiny_model, tokenizer):
    prompts = [p for p in ["1+2=", "13+4=", "9+9="] for _ in range(3)]
    for spec in (RolloutSpec(max_new_tokens=5, temperature=1.3, top_p=0.9),
                 RolloutSpec(max_new_tokens=6, temperature=0.8, stop=["1", "\n"])):
        ref = reference_sample(tiny_model, tokenizer, prompts, spec,
                               torch.Generator().manual_seed(3))
        tiny_model.train()
        batch = HFRollout(tiny_model, tokenizer).generate(prompts, spec,
                                                          torch.Generator().manual_seed(3))
        assert tiny_model.training  # mode restored
        assert torch.equal(batch.completion_ids, ref[0])
        assert torch.equal(batch.completion_mask, ref[2])
        assert torch.allclose(batch.logprobs, ref[1], atol=1e-5)
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        assert torch.equal(batch.prompt_ids, enc["input_ids"])
        assert torch.equal(batch.prompt_mask, enc["attention_mask"])
        for i, text in enumerate(batch.texts):
            row = batch.completion_ids[i][batch.completion_mask[i].bool()]
            assert text == cut_at_stop(tokenizer.decode(row, skip_special_tokens=True),
                                       spec.stop)[0]


def test_no_forward_after_the_last_token_and_outputs_feed_autograd(tiny_model, tokenizer):
    calls = count_forwards(tiny_model)
    backend = HFRollout(tiny_model, tokenizer, lockstep=True)  # never stops early
    spec = RolloutSpec(max_new_tokens=4)
    batch = backend.generate(["2+2="] * 4, spec, torch.Generator().manual_seed(0))
    assert batch.completion_ids.shape == (4, 4)
    assert calls[0] == 4  # prefill + 3 decodes: the 4th token needs no forward
    assert not batch.logprobs.is_inference() and not batch.completion_mask.is_inference()
    w = torch.zeros(4, 4, requires_grad=True)
    (torch.exp(w - batch.logprobs) * batch.completion_mask).sum().backward()
    assert w.grad is not None


def test_stops_as_soon_as_every_row_finished(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id

    def force_eos(module, args, out):  # every row samples eos as its first token
        out.logits[..., eos] = 1e4
        return out

    calls = count_forwards(tiny_model)
    tiny_model.register_forward_hook(force_eos)
    spec = RolloutSpec(max_new_tokens=6)
    batch = HFRollout(tiny_model, tokenizer).generate(["1+1="] * 3, spec,
                                                      torch.Generator().manual_seed(0))
    assert batch.completion_ids.tolist() == [[eos]] * 3
    assert batch.completion_mask.tolist() == [[1]] * 3
    assert calls[0] == 1 and batch.texts == ["", "", ""]


def test_remembered_prompt_ids_equal_the_tokenizers_padding(tiny_model, tokenizer):
    """Prompt texts are tokenized once per backend and padded by hand: the same ids, mask
    and rows as the tokenizer's own left-padded batch, on a first call and a repeat, with
    token-id prompts mixed in and with prefix sharing off."""
    backend = HFRollout(tiny_model, tokenizer)
    prompts = ["13+4=", "1+2=", "13+4=", "", "9+9=", "1+2="]
    for _ in range(2):  # the second call reads the remembered ids
        ids, mask, rows = backend.encode(prompts)
        enc = tokenizer(list(dict.fromkeys(prompts)), return_tensors="pt", padding=True,
                        add_special_tokens=False)
        assert torch.equal(ids, enc["input_ids"])
        assert torch.equal(mask, enc["attention_mask"])
        assert rows.tolist() == [0, 1, 0, 2, 3, 1]
    assert set(backend._ids) == set(prompts)
    as_ids = tokenizer("9+9=", add_special_tokens=False)["input_ids"]
    ids, mask, rows = backend.encode(["9+9=", as_ids, "1+2="])
    assert rows.tolist() == [0, 1, 2] and torch.equal(ids[0], ids[1])
    enc = tokenizer(["9+9=", "1+2="], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    assert torch.equal(ids[[0, 2]], enc["input_ids"])
    assert torch.equal(mask[[0, 2]], enc["attention_mask"])
    unshared = HFRollout(tiny_model, tokenizer, share_prefix=False)
    ids, mask, rows = unshared.encode(prompts)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(ids, enc["input_ids"]) and torch.equal(mask, enc["attention_mask"])
    assert rows.tolist() == list(range(len(prompts)))


def test_remembered_completion_texts_are_cut_per_call(tiny_model, tokenizer):
    """Decoded completions are remembered per backend, uncut: each call still cuts them at its
    own stop strings, and a repeat call gives the tokenizer's text."""
    backend = HFRollout(tiny_model, tokenizer)
    ids = torch.tensor(tokenizer(["12\n3", "7"], add_special_tokens=False,
                                 padding=True)["input_ids"])
    mask = (ids != tokenizer.pad_token_id).long()
    plain = [tokenizer.decode(r[m.bool()], skip_special_tokens=True)
             for r, m in zip(ids, mask, strict=True)]
    assert backend.texts(ids, mask, ["\n"]) == [cut_at_stop(t, ["\n"])[0] for t in plain]
    assert backend.texts(ids, mask, []) == plain
    assert backend.texts(ids, mask, ["\n"]) == [cut_at_stop(t, ["\n"])[0] for t in plain]
    assert len(backend._texts) == 2
