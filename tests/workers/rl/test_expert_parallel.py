"""Expert parallelism on CPU: two gloo ranks, each holding half the experts of the tiny
Qwen3-MoE, give the unsharded model's logits and gradients; bad layouts fail with a message.

The ranks are spawned processes (torch.multiprocessing, start method spawn) that write their
results to a folder; the test process computes the unsharded reference and compares."""

from __future__ import annotations

import copy
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from workers.rl import expert_parallel as ep
from workers.rl.distributed import free_port
from workers.rl.model import build_policy
from workers.rl.spec import ModelSpec, TinyMoeSpec

VOCAB = 64
SEQ = 12
# Each rank's [first, end) rows of the batch: uneven token counts and dispatch splits.
ROWS_2 = ((0, 3), (3, 4))
ROWS_4 = ((0, 2), (2, 3), (3, 5), (5, 6))
AUX_COEF = 0.01  # the router's balance loss is part of the loss, so its gradient path is checked
# float32 throughout. The sharded forward computes each expert on a different subset of rows
# and sums the all-reduced gradients in a different order than one process does, so results
# may differ by a few ulps of the summed terms (relative ~1e-7 per op, ~1e-6 after the ~10
# chained ops of this 2-layer model); values here are O(1) (logits) and O(1e-2..1) (grads),
# so 1e-5 absolute plus 1e-4 relative is two orders above rounding and far below the size of a
# real error (a wrong expert, a missing 1/world factor or a dropped token is >= 1e-3).
ATOL, RTOL = 1e-5, 1e-4


def _spec(num_experts: int = 4) -> ModelSpec:
    return ModelSpec(seed=11, router_aux_loss_coef=AUX_COEF,
                     preset=TinyMoeSpec(num_layers=2, num_experts=num_experts, hidden_size=32,
                                        moe_intermediate_size=32, head_dim=8, num_heads=4,
                                        num_kv_heads=2))


def _model(num_experts: int = 4) -> PreTrainedModel:
    return build_policy(_spec(num_experts), VOCAB, 0, 1)


def _batch(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(2, VOCAB, (rows, SEQ), generator=g)  # (rows, SEQ)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss): next-token cross-entropy plus the router's auxiliary loss."""
    out = model(input_ids=ids, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                           ids[:, 1:].reshape(-1))
    return out.logits, ce + AUX_COEF * out.aux_loss


def _rank_main(rank: int, world: int, ep_size: int, rows: tuple[tuple[int, int], ...],
               port: int, out_dir: str) -> None:
    """One EP rank: shard, forward its own rows, backward, sync grads, gather, save."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        model = _model()
        layout = ep.make_layout(ep_size)
        ep.shard_experts(model, layout)
        lo, hi = rows[rank]
        logits, loss = _loss(model, _batch(rows[-1][1])[lo:hi])
        loss.backward()
        ep.sync_gradients(model, layout)
        expert = {n for n, _ in ep.expert_parameters(model)}
        grads = {}
        for n, p in model.named_parameters():
            assert p.grad is not None, n
            grads[n] = ep.gather_experts(p.grad, layout) if n in expert else p.grad.clone()
        torch.save({"logits": logits.detach(), "grads": grads,
                    "state": ep.unsharded_state_dict(model, layout),
                    "expert_bytes": ep.expert_parameter_bytes(model)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Leave without C++ teardown: gloo objects freed after the process group sometimes abort a
    # rank that finished ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prefixed(name: str) -> Callable[[str], str]:
    """assert_close's message with the parameter's name in front."""
    return lambda m: f"{name}: {m}"


def _spawn(world: int, ep_size: int, rows: tuple[tuple[int, int], ...],
           out_dir: Path) -> list[dict]:
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    mp.spawn(_rank_main, args=(world, ep_size, rows, free_port(), str(out_dir)), nprocs=world,
             join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def _reference(rows: tuple[tuple[int, int], ...]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], PreTrainedModel]:
    """The unsharded model: whole-batch logits, and grads of the mean of the ranks' losses."""
    model = _model()
    ids = _batch(rows[-1][1])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    losses = [_loss(model, ids[lo:hi])[1] for lo, hi in rows]
    torch.stack(losses).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads, model


@pytest.mark.parametrize(("world", "ep_size", "rows"), [
    pytest.param(2, 2, ROWS_2, id="ep2-of-2"),
    # Two EP groups of 2 ranks: expert shards are also reduced over their expert-DP group.
    pytest.param(4, 2, ROWS_4, id="ep2-of-4"),
])
def test_ranks_holding_a_share_of_the_experts_match_the_unsharded_model(
        tmp_path: Path, world: int, ep_size: int, rows: tuple[tuple[int, int], ...]) -> None:
    ranks = _spawn(world, ep_size, rows, tmp_path)
    ref_logits, ref_grads, ref_model = _reference(rows)

    # Logits: each rank fed different rows; together they are the whole batch.
    got = torch.cat([r["logits"] for r in ranks])
    assert got.shape == ref_logits.shape
    torch.testing.assert_close(got, ref_logits, atol=ATOL, rtol=RTOL)

    # Gradients of every parameter, on both ranks (replicated ones averaged, experts gathered).
    names = {n for n, _ in ref_model.named_parameters()}
    assert set(ref_grads) == names  # every parameter gets a gradient in the reference too
    for r in ranks:
        assert set(r["grads"]) == names
        for n in names:
            torch.testing.assert_close(r["grads"][n], ref_grads[n], atol=ATOL, rtol=RTOL,
                                       msg=_prefixed(n))
        # The expert grads are not trivially zero: the comparison has teeth.
        assert r["grads"]["model.layers.0.mlp.experts.down_proj"].abs().max() > 1e-4

    # Gathered weights are exactly the original ones, and each rank holds 1/ep of the experts.
    full = ref_model.state_dict()
    for r in ranks:
        assert set(r["state"]) == set(full)
        for k, v in full.items():
            assert torch.equal(r["state"][k], v), k
        assert r["expert_bytes"] * ep_size == ep.expert_parameter_bytes(ref_model)


def test_one_rank_layout_is_the_unsharded_block() -> None:
    """EP size 1 (no process group) runs the dispatch code path locally: same logits and
    grads as transformers' own experts forward."""
    ref = _model()
    model = copy.deepcopy(ref)
    assert ep.shard_experts(model, ep.make_layout(1)) == ["model.layers.0.mlp",
                                                          "model.layers.1.mlp"]
    assert isinstance(model.model.layers[0].mlp, ep.ExpertParallelMoeBlock)
    ids = _batch(4)
    logits, loss = _loss(model, ids)
    ref_logits, ref_loss = _loss(ref, ids)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)
    loss.backward()
    ref_loss.backward()
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n].grad, p.grad, atol=ATOL, rtol=RTOL)


def test_experts_not_divisible_by_ep_size_raise_before_changing_the_model() -> None:
    model = _model(num_experts=6)
    layout = ep.ExpertParallelLayout(world_size=4, rank=1, ep_size=4, ep_rank=1)
    with pytest.raises(ep.ExpertParallelError, match="6 experts cannot be split evenly over "
                                                     "expert-parallel size 4"):
        ep.shard_experts(model, layout)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6  # untouched


def test_ep_size_must_divide_the_world() -> None:
    with pytest.raises(ep.ExpertParallelError, match="must divide the world size 1"):
        ep.make_layout(2)


def test_a_model_without_moe_blocks_is_refused() -> None:
    with pytest.raises(ep.ExpertParallelError, match="no sparse MoE blocks"):
        ep.shard_experts(torch.nn.Linear(4, 4), ep.make_layout(1))
