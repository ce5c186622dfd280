"""4-bit gradient compression: the quantisation maths by hand, error feedback's bounded running
error, and real gloo process groups (2 ranks flat, 2 "nodes" x 2 ranks hierarchical, a DDP model
with the hook).

Tolerances are derived, not tuned: one 4-bit round trip errs by at most half a step (scale / 2)
of its block, so one compressed all-reduce of W inputs errs by at most sum_i s_i/2 (each rank's
quantisation) + s_R/2 (the owner re-quantising the sum), where s_R <= (absmax of the exact sum +
sum_i s_i/2) / 7. The only slack on top is for float32 summation order (1e-5 relative).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.skips import host_reason
from workers.rl import grad_compress as gc
from workers.rl.distributed import free_port

BLOCK = gc.DEFAULT_BLOCK


# --- quantisation maths, by hand ---------------------------------------------------------------


def test_quantize_a_block_by_hand() -> None:
    # absmax 7 -> scale exactly 1.0; codes round(x / 1): 7, -3, 1, 3, then zeros (padding).
    x = torch.tensor([7.0, -3.4, 0.6, 2.6])
    q = gc.quantize(x, block=4)
    assert q.scales.tolist() == [1.0]
    # nibbles are code + 8: 15, 5, 9, 11; even element in the low nibble.
    assert q.codes.tolist() == [15 | (5 << 4), 9 | (11 << 4)] == [95, 185]
    assert gc.dequantize(q).tolist() == [7.0, -3.0, 1.0, 3.0]


def test_two_blocks_padding_and_zero_block() -> None:
    # Block 2, five elements -> three blocks (the last padded with a zero):
    #   [-3.5, 1.2]: absmax 3.5 -> scale 0.5; codes -7, round(2.4) = 2 -> nibbles 1, 10
    #   [0, 0]:      scale 0, codes 0 -> nibbles 8, 8; dequantises to exact zeros
    #   [0.875, pad]: scale 0.125; codes 7, 0 -> nibbles 15, 8
    x = torch.tensor([-3.5, 1.2, 0.0, 0.0, 0.875])
    q = gc.quantize(x, block=2)
    assert q.scales.tolist() == [0.5, 0.0, 0.125]
    assert q.numel == 5
    assert q.codes.tolist() == [1 | (10 << 4), 8 | (8 << 4), 15 | (8 << 4)]
    assert gc.dequantize(q).tolist() == [-3.5, 1.0, 0.0, 0.0, 0.875]


def test_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    for scale_dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(64 * 150, generator=g) * torch.logspace(-3, 1, 64 * 150)
        q = gc.quantize(x, BLOCK, scale_dtype)
        err = (gc.dequantize(q) - x).abs()
        bound = gc.max_abs_error(x, BLOCK, scale_dtype)
        assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
        # and the bound is half a step: absmax/14 (scale rounding < 0.4% for bf16)
        absmax = x.view(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK)
        assert bool((bound <= absmax / 14 * 1.004 + 1e-12).all())


def test_wire_size_is_about_half_a_byte_per_element() -> None:
    x = torch.randn(64 * 1000)
    q = gc.quantize(x)
    wire = gc.to_wire(q)
    assert wire.dtype == torch.uint8
    assert wire.numel() == gc.wire_bytes(x.numel(), BLOCK, torch.bfloat16) == 64 * 1000 * 17 // 32
    back = gc.from_wire(wire, x.numel(), BLOCK, torch.bfloat16)
    assert torch.equal(gc.dequantize(back), gc.dequantize(q))
    # vs the bandwidth-optimal fp32 all-reduce on 2 ranks: the 4-bit one sends 2*(1/2)*wire
    assert gc.uncompressed_all_reduce_bytes(x.numel(), 2, 4) == x.numel() * 4


def test_error_feedback_tracks_the_running_sum() -> None:
    # A persistent small component (0.01, far below half a step of a block whose absmax is ~3)
    # always rounds to zero: without feedback it is lost every step and the running error grows
    # linearly (0.01 * steps); with feedback the running error equals minus the residual, which
    # stays below half a step whatever the number of steps.
    g = torch.Generator().manual_seed(1)
    steps = 300
    ef = gc.ErrorFeedback()
    true_sum = torch.zeros(4 * BLOCK)
    sent_ef = torch.zeros(4 * BLOCK)
    sent_plain = torch.zeros(4 * BLOCK)
    for _ in range(steps):
        x = torch.randn(4 * BLOCK, generator=g)
        x[1::2] = 0.01
        true_sum += x
        _, deq = ef.quantize("w", x, BLOCK, torch.bfloat16)
        sent_ef += deq
        sent_plain += gc.dequantize(gc.quantize(x, BLOCK))
    err_ef = (sent_ef - true_sum).abs()
    torch.testing.assert_close(sent_ef - true_sum, -ef.residuals["w"], rtol=0, atol=1e-3)
    assert err_ef.max().item() < 4.5 / 14  # half a step for absmax <= ~4.5 (randn, 256 draws)
    assert (sent_plain - true_sum)[1::2].abs().mean().item() > 0.5 * 0.01 * steps


# --- real process groups (gloo) ----------------------------------------------------------------


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    """Rank r's step-t input, reproducible on every rank (so each can compute the exact sum)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, generator=g) * (1 + rank)
    x[::7] = 0.003  # a persistent small signal that 4 bits alone would drop
    return x


def _one_step_bound(inputs: list[torch.Tensor], n_owners: int) -> torch.Tensor:
    """The derived per-element bound on |compressed sum - exact sum| (module docstring)."""
    n = inputs[0].numel()
    chunk = gc.padded_length(-(-n // n_owners), BLOCK)
    pad = n_owners * chunk - n

    def halfstep(x: torch.Tensor) -> torch.Tensor:
        xp = torch.cat([x, x.new_zeros(pad)]).view(-1, BLOCK)
        return (xp.abs().amax(1) / gc.LEVELS * 1.004 / 2).repeat_interleave(BLOCK)[:n]

    per_rank = sum(halfstep(x) for x in inputs)
    exact = torch.stack(inputs).sum(0)
    # the owner's sum deviates from exact by <= per_rank, so its absmax grows by <= that much
    xp = torch.cat([exact.abs() + per_rank, exact.new_zeros(pad)]).view(-1, BLOCK)
    owner = (xp.amax(1) / gc.LEVELS * 1.004 / 2).repeat_interleave(BLOCK)[:n]
    return (per_rank + owner) * (1 + 1e-5) + 1e-6


N = 1000  # not a multiple of the block or the world: exercises padding


def _flat_worker(rank: int, world: int, port: int, steps: int) -> None:
    _init(rank, world, port)
    try:
        wef, sef, counter = gc.ErrorFeedback(), gc.ErrorFeedback(), gc.ByteCounter()
        plain = gc.CompressConfig(error_feedback=False)
        cum_err_ef = torch.zeros(N)
        cum_err_plain = torch.zeros(N)
        for t in range(steps):
            inputs = [_grad(r, t, N) for r in range(world)]
            exact = torch.stack(inputs).sum(0)
            out, _ = gc.compressed_all_reduce_sum(inputs[rank], worker_ef=wef, server_ef=sef,
                                                  counter=counter)
            out_plain, _ = gc.compressed_all_reduce_sum(inputs[rank], cfg=plain)
            # identical on every rank (replicas must not diverge)
            both = [torch.empty(N) for _ in range(world)]
            dist.all_gather(both, out)
            assert all(torch.equal(b, out) for b in both)
            # one step: within the derived bound of the exact sum (EF adds a residual that is
            # itself bounded, so only the plain step is held to the one-step bound)
            assert bool(((out_plain - exact).abs() <= _one_step_bound(inputs, world)).all())
            if t == 0:  # no residual yet: EF's first step is a plain step
                assert torch.equal(out, out_plain)
            cum_err_ef += out - exact
            cum_err_plain += out_plain - exact
        # Running error with EF is exactly minus (sum of worker residuals + server residual):
        # bounded by one step's quantisation error, however many steps ran.
        res = torch.cat([r.reshape(-1) for r in wef.residuals.values()])
        dist.all_reduce(res)
        chunk = gc.padded_length(-(-N // world), BLOCK)
        server = torch.zeros(world * chunk)
        server[rank * chunk:(rank + 1) * chunk] = next(iter(sef.residuals.values()))
        dist.all_reduce(server)
        torch.testing.assert_close(cum_err_ef, -(res + server)[:N], rtol=0, atol=2e-3)
        last = [_grad(r, steps - 1, N) for r in range(world)]
        assert cum_err_ef.abs().max().item() <= 2 * _one_step_bound(last, world).max().item()
        # Without EF the small persistent signal (0.003 * world per step) is lost every step.
        assert cum_err_plain[::7].abs().mean().item() > 0.5 * 0.003 * world * steps
        # bytes: 2 (W-1) chunks of 4-bit payload + bf16 scales per all-reduce, self excluded
        assert counter.inter == steps * 2 * (world - 1) * gc.wire_bytes(chunk, BLOCK,
                                                                         torch.bfloat16)
    finally:
        dist.destroy_process_group()


def _hier_worker(rank: int, world: int, port: int, steps: int) -> None:
    _init(rank, world, port)
    try:
        plan = gc.NodePlan.build([0, 0, 1, 1])
        assert plan.n_nodes == 2 and plan.is_leader == (rank in (0, 2))
        wef, sef, counter = gc.ErrorFeedback(), gc.ErrorFeedback(), gc.ByteCounter()
        cum_err = torch.zeros(N)
        for t in range(steps):
            inputs = [_grad(r, t, N) for r in range(world)]
            exact = torch.stack(inputs).sum(0)
            out = gc.hierarchical_all_reduce_sum(inputs[rank], plan, worker_ef=wef,
                                                 server_ef=sef, counter=counter)
            both = [torch.empty(N) for _ in range(world)]
            dist.all_gather(both, out)
            assert all(torch.equal(b, out) for b in both)
            if t == 0:  # leaders quantise their node's exact (fp32) sum: 2 inputs, 2 owners
                node_sums = [inputs[0] + inputs[1], inputs[2] + inputs[3]]
                assert bool(((out - exact).abs() <= _one_step_bound(node_sums, 2)).all())
            cum_err += out - exact
        last = [_grad(0, steps - 1, N) + _grad(1, steps - 1, N),
                _grad(2, steps - 1, N) + _grad(3, steps - 1, N)]
        assert cum_err.abs().max().item() <= 2 * _one_step_bound(last, 2).max().item()
        chunk = gc.padded_length(-(-N // 2), BLOCK)
        per = gc.wire_bytes(chunk, BLOCK, torch.bfloat16)
        if plan.is_leader:
            # across nodes: one chunk out in the all-to-all, one in the all-gather, per step
            assert counter.inter == steps * 2 * per
            assert counter.intra == steps * 2 * per  # the 4-bit result broadcast to 1 peer
        else:
            assert counter.inter == 0 and counter.intra == steps * N * 4  # fp32 to its leader
    finally:
        dist.destroy_process_group()


def _ddp_worker(rank: int, world: int, port: int, steps: int) -> None:
    _init(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(),
                                    torch.nn.Linear(30, 5))
        reference = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = gc.register(ddp)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 40, generator=g), torch.randn(16, 5, generator=g)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        exact = local.clone()
        dist.all_reduce(exact)
        exact /= world
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got)
        assert all(torch.equal(t, got) for t in gathered), "replicas got different gradients"
        locals_ = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(locals_, local)
        # DDP lays parameters out in its own bucket order, so bound each block's absmax by the
        # whole vector's (a_i per rank): the derived bound on the sum is
        # sum a_i/14 + (sum a_i + sum a_i/14)/14, times 1.004 for bf16 scale rounding.
        a = sum(t.abs().max().item() for t in locals_)
        bound = (a / 14 + (a + a / 14) / 14) * 1.004 / world
        assert (got - exact).abs().max().item() <= bound + 1e-6
        assert torch.corrcoef(torch.stack([got, exact]))[0, 1].item() > 0.97
        n = got.numel()
        assert state.elements == n
        assert 0 < state.counter.inter < 0.15 * gc.uncompressed_all_reduce_bytes(n, world, 4)
    finally:
        dist.destroy_process_group()


def _rank(rank: int, fn, world: int, port: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    """Run one rank's checks, then leave without C++ teardown: gloo and DDP objects destroyed
    after the process group sometimes abort a rank whose checks all passed ("terminate called
    without an active exception"). A failed check raises before this and fails the test."""
    if torch.cuda.device_count() < world:  # a GPU host with fewer GPUs than ranks: CPU ranks
        os.environ["CRUCIBLE_DEVICE"] = "cpu"
    fn(rank, world, port, steps)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, world: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_rank, args=(fn, world, free_port(), steps), nprocs=world, join=True)


@pytest.mark.slow
def test_two_ranks_flat_all_reduce_and_error_feedback() -> None:
    _spawn(_flat_worker, 2, 60)


@pytest.mark.slow
def test_two_nodes_by_two_ranks_hierarchical() -> None:
    _spawn(_hier_worker, 4, 40)


@pytest.mark.slow
def test_ddp_hook_averages_gradients_in_four_bits() -> None:
    _spawn(_ddp_worker, 2, 1)


# --- RunSpec wiring: DeepSpeed stage 0 gets the 4-bit all-reduce; ZeRO++ mapping ------------


def test_spec_refuses_compression_under_zero_and_zeropp_off_stage_3() -> None:
    from workers.rl.spec import SpecError, parse_spec

    assert parse_spec({"trainer": {"zero_stage": 0, "grad_compression": "4bit"}}) \
        .trainer.grad_compression == "4bit"
    with pytest.raises(SpecError, match="DeepSpeed owns the gradient communication"):
        parse_spec({"trainer": {"zero_stage": 2, "grad_compression": "4bit"}})
    with pytest.raises(SpecError, match="needs zero_stage = 3"):
        parse_spec({"trainer": {"zero_stage": 2, "zeropp": {"quantized_gradients": True}}})


def test_arch_list_as_deepspeed_reads_it() -> None:
    """An image's arch-specific TORCH_CUDA_ARCH_LIST broke DeepSpeed's JIT builder on an H200."""
    from workers.rl.engine import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0 9.0a+PTX") == "8.0;9.0+PTX"
    assert deepspeed_arch_list("9.0;9.0a;10.0a") == "9.0;10.0"
    assert deepspeed_arch_list("8.6+PTX") == "8.6+PTX"


def test_zeropp_config_mapping_and_cpu_refusal() -> None:
    from workers.rl.engine import ZeroPPUnavailable, zeropp_config
    from workers.rl.spec import TrainerSpec, ZeroPPSpec

    full = TrainerSpec(zero_stage=3, zeropp=ZeroPPSpec(quantized_weights=True,
                                                       quantized_gradients=True,
                                                       hpz_partition_size=8))
    assert zeropp_config(full, cuda=True) == {"zero_quantized_weights": True,
                                              "zero_quantized_gradients": True,
                                              "zero_hpz_partition_size": 8}
    with pytest.raises(ZeroPPUnavailable, match="ZeRO\\+\\+ quantisation needs a GPU"):
        zeropp_config(full, cuda=False)
    # hpZ alone runs on CPU; nothing set maps to nothing
    hpz = TrainerSpec(zero_stage=3, zeropp=ZeroPPSpec(hpz_partition_size=2))
    assert zeropp_config(hpz, cuda=False) == {"zero_hpz_partition_size": 2}
    assert zeropp_config(TrainerSpec(), cuda=False) == {}


def _deepspeed_worker(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from workers.rl.distributed import process_group
    from workers.rl.engine import make_engine
    from workers.rl.spec import TrainerSpec

    with process_group():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(),
                                    torch.nn.Linear(30, 5))
        reference = copy.deepcopy(model)
        ts = TrainerSpec(zero_stage=0, grad_compression="4bit", grad_clip=0.0)
        engine = make_engine(model, ts, lr=1e-2, total_steps=steps, micro=16, gas=1)
        state = engine.crucible_grad_compress
        n = sum(p.numel() for p in model.parameters())
        worst, cum_err = torch.zeros(n), torch.zeros(n)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 40, generator=g), torch.randn(16, 5, generator=g)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            reference.load_state_dict(engine.module.state_dict())
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            got = torch.cat([p.grad.reshape(-1) for p in engine.module.parameters()])
            local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
            exact = local.clone()
            dist.all_reduce(exact)
            exact /= world
            locals_ = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(locals_, local)
            bound = _one_step_bound(locals_, world) / world  # flat blocks, as we built them
            worst = torch.maximum(worst, bound)
            if step == 0:  # no residual yet: within one step's bound
                assert bool(((got - exact).abs() <= bound).all())
                assert torch.corrcoef(torch.stack([got, exact]))[0, 1].item() > 0.97
            cum_err += got - exact
            engine.step()
        # later steps carry the last residual in and the new one out: the running error is
        # minus the current residuals, within twice the largest one-step bound, not growing
        assert bool((cum_err.abs() <= 2 * worst).all())
        # the replicas stayed identical and the hook carried every step
        w = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        ws = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(ws, w)
        assert all(torch.equal(v, w) for v in ws)
        assert state.elements == steps * n
        assert state.counter.inter == steps * 2 * (world - 1) * gc.wire_bytes(
            gc.padded_length(-(-n // world), BLOCK), BLOCK, torch.bfloat16)


@pytest.mark.slow
def test_deepspeed_stage0_trains_through_the_4bit_all_reduce() -> None:
    _spawn(_deepspeed_worker, 2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason=host_reason("ZeRO++ quantisation needs a GPU (DeepSpeed has no CPU "
                                       "kernels)"))
def test_zeropp_quantised_stage3_step_on_gpu() -> None:
    from workers.rl.distributed import process_group
    from workers.rl.engine import make_engine
    from workers.rl.spec import TrainerSpec, ZeroPPSpec

    with process_group():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 8))
        ts = TrainerSpec(zero_stage=3, precision="bf16",
                         zeropp=ZeroPPSpec(quantized_weights=True, quantized_gradients=True))
        engine = make_engine(model, ts, lr=1e-3, total_steps=3, micro=8, gas=1)
        losses = []
        for _ in range(3):
            x = torch.randn(8, 64, device=engine.device, dtype=torch.bfloat16)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses)))


TRAIN_CONFIG = """
name = "two-ranks-4bit"
[model]
seed = 3
[model.preset]
num_layers = 2
num_experts = 4
hidden_size = 32
moe_intermediate_size = 32
[sft]
steps = 4
batch_size = 8
[rollout]
group_size = 4
max_new_tokens = 4
[trainer]
steps = 3
prompts_per_step = 4
micro_batch_size = 4
zero_stage = 0
grad_compression = "{compression}"
seed = 7
[checkpoint]
dir = "{{dir}}/ckpt"
save_final = false
[output]
metrics_jsonl = "{{dir}}/metrics.jsonl"
stdout = true
"""


@pytest.mark.slow
def test_a_two_rank_train_run_uses_the_4bit_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The trainer's SFT and RL phases on 2 ranks (torchrun, gloo, DeepSpeed stage 0) finish with
    # finite losses; the same run uncompressed reports different losses (the updates differ by
    # the quantisation error), so the 4-bit all-reduce was really the one in use.
    from tests.workers.rl.test_rl_distributed import finish, launch, losses

    got = {}
    for mode in ("4bit", "none"):
        run_dir = tmp_path / mode
        finish(launch(run_dir, config=TRAIN_CONFIG.format(compression=mode)), run_dir)
        got[mode] = losses(run_dir)
    assert sorted(got["4bit"]) == sorted(got["none"]) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(list(got["4bit"].values()))))
    assert got["4bit"] != got["none"]
