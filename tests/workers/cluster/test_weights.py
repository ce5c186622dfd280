"""Weight buckets (pure layout, flatten, unflatten, checksum) and the learner → actor channel
over a real two-process gloo group (two threads here, each with its own group end)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.skips import host_reason
from workers.cluster.weights import (
    WeightChannel,
    WeightPushTimeout,
    checksum,
    flatten,
    layout_of,
    unflatten,
)
from workers.rl.distributed import free_port


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(4, 3, generator=g),
        "a.bias": torch.randn(5, generator=g),
        "c.big": torch.randn(10, 10, generator=g),
        "half": torch.randn(6, generator=g).to(torch.bfloat16),
        "steps": torch.arange(3, dtype=torch.int64),
    }


def test_layout_groups_by_dtype_in_name_order_and_caps_buckets():
    lay = layout_of(state(), bucket_bytes=80)  # 20 float32 elements per bucket
    f32 = [s for s in lay.slots if s.dtype == "float32"]
    assert [s.name for s in f32] == ["a.bias", "b.weight", "c.big"]
    # a.bias (5) and b.weight (12) share a bucket; c.big (100) exceeds the cap: its own.
    assert f32[0].offset == 0
    assert f32[1].bucket == f32[0].bucket and f32[1].offset == 5
    assert f32[2].bucket != f32[0].bucket and f32[2].offset == 0
    assert sorted(lay.buckets) == sorted([("bfloat16", 6), ("float32", 17), ("float32", 100),
                                          ("int64", 3)])
    assert lay.nbytes() == 6 * 2 + 117 * 4 + 3 * 8
    one = layout_of(state())  # the default cap holds each dtype in one bucket
    assert len(one.buckets) == 3


def test_flatten_then_unflatten_is_bitwise_the_state():
    s = state()
    lay = layout_of(s, bucket_bytes=80)
    buckets = flatten(s, lay)
    back = unflatten(buckets, lay)
    assert set(back) == set(s)
    for k in s:
        assert back[k].dtype == s[k].dtype and torch.equal(back[k], s[k]), k
    assert checksum(buckets) == checksum(flatten(back, lay))


def test_checksum_sees_a_single_bit():
    s = state()
    lay = layout_of(s)
    before = checksum(flatten(s, lay))
    s["c.big"].view(torch.int32)[3, 4] ^= 1  # the lowest mantissa bit of one weight
    assert checksum(flatten(s, lay)) != before


def test_flatten_refuses_a_state_of_another_shape():
    s = state()
    lay = layout_of(s)
    with pytest.raises(ValueError, match="missing \\['steps'\\]"):
        flatten({k: v for k, v in s.items() if k != "steps"}, lay)
    s["a.bias"] = torch.zeros(6)
    with pytest.raises(ValueError, match="a.bias: \\(6,\\) float32 where the layout has"):
        flatten(s, lay)
    with pytest.raises(ValueError, match="empty state dict"):
        layout_of({})


def test_the_channel_carries_the_buckets_bitwise():
    s = state()
    lay = layout_of(s, bucket_bytes=80)
    port, got = free_port(), {}

    def actor() -> None:
        ch = WeightChannel("127.0.0.1", port, rank=1, timeout_s=30)
        got["buckets"] = ch.recv(lay)

    t = threading.Thread(target=actor)
    t.start()
    learner = WeightChannel("127.0.0.1", port, rank=0, timeout_s=30)
    sent = flatten(s, lay)
    learner.send(sent)
    t.join(30)
    assert checksum(got["buckets"]) == checksum(sent)
    for k, v in unflatten(got["buckets"], lay).items():
        assert torch.equal(v, s[k])


def test_a_receiver_that_never_joins_times_out_loudly():
    """The actor side connects but never receives: the learner's send fails in bounded time
    instead of hanging (gloo's own timeout, raised as WeightPushTimeout)."""
    s = {"w": torch.zeros(4 * 1024 * 1024)}  # 16 MB: more than loopback buffers hold
    lay = layout_of(s)
    port, ready, done = free_port(), threading.Event(), threading.Event()

    def idle_actor() -> None:
        WeightChannel("127.0.0.1", port, rank=1, timeout_s=2)
        ready.set()
        done.wait(30)

    t = threading.Thread(target=idle_actor, daemon=True)
    t.start()
    learner = WeightChannel("127.0.0.1", port, rank=0, timeout_s=2)
    ready.wait(30)
    with pytest.raises(WeightPushTimeout, match="sending weights: bucket 1/1 did not complete"):
        learner.send(flatten(s, lay))
    done.set()


def _nccl_end(rank: int, port: int, out: str) -> None:
    """One end of the NCCL test, in its own process on GPU `rank`."""
    torch.cuda.set_device(rank)
    lay = layout_of(state(), bucket_bytes=80)
    ch = WeightChannel("127.0.0.1", port, rank=rank, timeout_s=60, device=f"cuda:{rank}")
    if rank == 0:
        ch.send(flatten(state(), lay, f"cuda:{rank}"))
    else:
        with open(out, "w") as f:
            f.write(checksum(ch.recv(lay)))


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=host_reason(
                        "the NCCL weight push needs two GPUs, one per end (NCCL refuses two "
                        f"ranks on one device); this host has {torch.cuda.device_count()}"))
def test_the_nccl_channel_carries_the_buckets_bitwise(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "received"
    mp.spawn(_nccl_end, args=(free_port(), str(out)), nprocs=2)
    assert out.read_text() == checksum(flatten(state(), layout_of(state(), bucket_bytes=80)))
