"""The RL samples a run reports: a few prompts and completions per step, with what the update
made of them (reward and its components, group-relative advantage, the weight version that
sampled them, why generation stopped), for the run page's samples viewer.

`pick_samples` is pure: which sequences of a step's batch, laid out as rows the sink sends.
Text is capped in UTF-8 bytes per step (`samples.max_bytes`), so a run with long completions
reports as cheaply as one with short ones.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.rl.spec import SamplesSpec

TRUNCATED = " …[truncated]"


def reports_at(spec: SamplesSpec, step: int) -> bool:
    """Whether RL step `step` (1-based, as metrics number them) reports samples."""
    return spec.per_step > 0 and step % spec.every == 0


def clip_text(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (a marker included), never mid-character."""
    data = text.encode()
    if len(data) <= limit:
        return text
    marker = TRUNCATED.encode()
    keep = max(0, limit - len(marker))
    return data[:keep].decode("utf-8", "ignore") + (TRUNCATED if limit >= len(marker) else "")


def finish_reason(completion_mask: torch.Tensor, completion_ids: torch.Tensor, eos_id: int,
                  max_new_tokens: int, episode: bool) -> list[str]:
    """Per sequence: `stop` (it sampled eos or hit a stop string before the token budget),
    `length` (it used the whole budget without eos), `episode` (a multi-turn or tool-use
    episode, ended by its environment or its budgets)."""
    if episode:
        return ["episode"] * completion_ids.shape[0]
    lengths = completion_mask.sum(-1).tolist()  # (B,)
    out = []
    for row, n in zip(completion_ids.tolist(), lengths, strict=True):
        n = int(n)
        ended = n > 0 and row[n - 1] == eos_id
        out.append("stop" if ended or n < max_new_tokens else "length")
    return out


def pick_samples(
    spec: SamplesSpec, *, prompts: list[str], texts: list[str], rewards: list[float],
    components: dict[str, list[float]], advantages: list[float], versions: list[int],
    reasons: list[str],
) -> list[dict[str, Any]]:
    """`spec.per_step` sequences spread evenly over the step's batch (every group gets its
    turn across steps' worth of prompts), as sample rows. Each row's prompt and completion
    share the step's byte budget equally; a shorter field leaves its share to the other."""
    n = len(texts)
    k = min(spec.per_step, n)
    if k == 0:
        return []
    picked = [i * n // k for i in range(k)]
    budget = spec.max_bytes // k
    rows = []
    for i in picked:
        prompt_bytes = len(prompts[i].encode())
        completion_bytes = len(texts[i].encode())
        half = budget // 2
        prompt_limit = max(half, budget - completion_bytes)
        completion_limit = max(budget - half, budget - prompt_bytes)
        rows.append({
            "prompt": clip_text(prompts[i], min(prompt_limit, budget)),
            "completion": clip_text(texts[i], min(completion_limit, budget)),
            "reward": float(rewards[i]),
            "reward_components": {name: float(values[i]) for name, values in components.items()},
            "advantage": float(advantages[i]),
            "weight_version": int(versions[i]),
            "finish_reason": reasons[i],
        })
    return rows
