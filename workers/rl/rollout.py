"""Rollout generation behind one interface, so a vLLM backend can replace the HF one.

A backend returns token ids and the sampling policy's per-token logprobs, laid out exactly as
the trainer will re-score them: left-padded prompt, then right-padded completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from workers.rl.spec import RolloutSpec


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (B,P) left-padded
    prompt_mask: torch.Tensor  # (B,P) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (B,C) right-padded with pad id
    completion_mask: torch.Tensor  # (B,C) 1 on sampled tokens, including the eos/stop token
    logprobs: torch.Tensor  # (B,C) log-prob of each sampled token under the sampling policy
    texts: list[str]  # decoded completions, cut at the first stop string

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


class RolloutBackend(Protocol):
    def generate(
        self, prompts: list[str], spec: RolloutSpec, generator: torch.Generator
    ) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the backend sample from the trainer's current weights (a no-op when shared)."""
        ...


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, so a prompt's tokens sit at 0..n-1 in any batch."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set whose mass reaches top_p; renormalise. (B,V)."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class HFRollout:
    """Batched sampling with the KV cache straight from a Hugging Face causal LM.

    `lockstep` keeps decoding until max_new_tokens even when every row has finished: ZeRO-3
    ranks gather parameters collectively in each forward, so all ranks must run equally many.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, lockstep: bool = False):
        self.model = model
        self.tok = tokenizer
        self.lockstep = lockstep

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(
        self, prompts: list[str], spec: RolloutSpec, generator: torch.Generator
    ) -> RolloutBatch:
        tok = self.tok
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
        b = prompt_ids.shape[0]
        device = next(self.model.parameters()).device
        ids, attn = prompt_ids.to(device), prompt_mask.to(device)
        pos = position_ids(attn)
        was_training = self.model.training
        self.model.eval()
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]  # (B,V)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        new_ids, new_lp, new_mask = [], [], []
        texts = [""] * b
        for _ in range(spec.max_new_tokens):
            logp = torch.log_softmax(logits.float() / spec.temperature, dim=-1)  # (B,V)
            probs = top_p_filter(logp.exp(), spec.top_p)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
            new_ids.append(nxt)
            new_lp.append(torch.where(done, 0.0, logp.gather(-1, nxt[:, None]).squeeze(-1)))
            new_mask.append((~done).long())
            done = done | (nxt == tok.eos_token_id)
            if spec.stop:
                so_far = torch.stack(new_ids, 1)
                for i in torch.nonzero(~done).flatten().tolist():
                    text = tok.decode(so_far[i], skip_special_tokens=True)
                    if cut_at_stop(text, spec.stop)[1]:
                        done[i] = True
            if bool(done.all()) and not self.lockstep:
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=attn,
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
            cache, logits = out.cache, out.logits[:, -1]
        self.model.train(was_training)
        comp = torch.stack(new_ids, 1).cpu()  # (B,C)
        mask = torch.stack(new_mask, 1).cpu()
        for i in range(b):
            text = tok.decode(comp[i][mask[i].bool()], skip_special_tokens=True)
            texts[i] = cut_at_stop(text, spec.stop)[0]
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=comp,
            completion_mask=mask,
            logprobs=torch.stack(new_lp, 1).cpu(),
            texts=texts,
        )


def make_backend(name: str, model: torch.nn.Module, tokenizer, lockstep: bool) -> RolloutBackend:
    if name == "hf":
        return HFRollout(model, tokenizer, lockstep=lockstep)
    raise ValueError(f"unknown rollout backend {name!r}; available: 'hf'")
