"""Offline DPO on pinned preference datasets: the second warm-start phase, after SFT.

Each step samples ``preference.batch_size`` pairs (split over ranks), scores the chosen and
the rejected completion under the policy and under a frozen copy of the policy it started
from (the SFT output, or the initial model), and minimises the DPO loss of
``workers.rl.losses.dpo_loss``. The result is saved as ``<checkpoint dir>/preference`` and RL
starts from it; a run that finds that folder (a resumed attempt) does not train it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from workers.reporting import Reporter
from workers.rl import checkpoint as ckpt
from workers.rl.distributed import all_reduce_sum
from workers.rl.engine import frozen_copy, make_engine
from workers.rl.forward import completion_batch, sequence_logps
from workers.rl.losses import dpo_loss, load_balancing_loss
from workers.rl.model import build_policy, is_moe
from workers.rl.objectives import Example
from workers.rl.pinned_data import PinnedData, check_roles
from workers.rl.prompt_format import PromptFormat
from workers.rl.spec import RunSpec


class PhaseHost(Protocol):
    """What the preference phase reads from the run it warms up (the trainer satisfies it):
    a protocol, so this module never imports the training loop that calls it."""

    spec: RunSpec
    root: Path
    device: torch.device
    rank: int
    world: int
    pinned: PinnedData
    sink: Reporter
    prompt_format: PromptFormat

    def generator(self, *key: int) -> torch.Generator: ...

    def warmup_stop(self, phase: str, step: int) -> None: ...


def check_pinned(spec: RunSpec, pinned: PinnedData) -> None:
    """The engine's side of the launch check (pinned_data.check_roles)."""
    check_roles({label: role for label, (role, _) in pinned.sources.items()},
                sft_steps=spec.sft.steps, sft_environment=spec.sft.environment,
                preference_steps=spec.preference.steps)


def preference_phase(run: PhaseHost, tok: Any, start: Path) -> Path:
    """DPO from the model in ``start`` (or the spec's initial model when ``start`` holds
    none); returns the folder RL should start from."""
    spec, out = run.spec, run.root / "preference"
    pref = spec.preference
    if pref.steps == 0:
        return start
    if (out / "config.json").is_file():
        return out
    model_spec = spec.model
    if (start / "config.json").is_file():
        model_spec = model_spec.model_copy(update={"source": "path", "path": str(start)})
    policy = build_policy(model_spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    reference = frozen_copy(policy, run.device)
    per_rank = max(1, pref.batch_size // run.world)
    ts = spec.trainer.model_copy(update={"schedule": "constant", "warmup_steps": 0})
    # One micro-batch holds each pair's chosen and rejected rows.
    engine = make_engine(policy, ts, pref.lr, pref.steps, 2 * per_rank, 1)
    moe = is_moe(policy)
    pairs = run.pinned.preference
    for step in range(pref.steps):
        run.warmup_stop("preference (DPO)", step)
        g = run.generator(40_000 + step, run.rank)
        picked = [pairs[int(i)] for i in torch.randint(len(pairs), (per_rank,), generator=g)]
        # One batch: each pair's chosen rows, then its rejected rows.
        batch = completion_batch(
            tok, [Example(prompt=p.prompt, reference=p.chosen) for p in picked]
            + [Example(prompt=p.prompt, reference=p.rejected) for p in picked])
        seq, router, flat_mask = sequence_logps(engine, batch, moe, run.device)
        with torch.no_grad():
            ref_seq, _, _ = sequence_logps(reference, batch, False, run.device)
        n = len(picked)
        loss, acc = dpo_loss(seq[:n], seq[n:], ref_seq[:n], ref_seq[n:], pref.beta)
        if router is not None:
            k = engine.module.config.num_experts_per_tok
            loss = loss + spec.model.router_aux_loss_coef * load_balancing_loss(
                router, k, flat_mask)
        engine.backward(loss)
        engine.step()
        if step % 10 == 0 or step == pref.steps - 1:
            margin = ((seq[:n] - ref_seq[:n]) - (seq[n:] - ref_seq[n:])).mean().detach().cpu()
            totals = all_reduce_sum(torch.stack([loss.detach().cpu(), acc.cpu(), margin]))
            loss_v, acc_v, margin_v = (float(v) / run.world for v in totals)
            run.sink.log(step, {"preference/loss": loss_v, "preference/accuracy": acc_v,
                                "preference/margin": margin_v})
    ckpt.save_hf_atomic(engine.module, tok, out, spec.trainer.zero_stage, run.prompt_format)
    run.sink.event("info", f"preference (DPO) warm start done after {pref.steps} steps on "
                   f"{len(pairs)} pairs", {})
    del engine, reference
    return out


__all__ = ["PhaseHost", "check_pinned", "preference_phase"]
