"""Weight push learner → rollout actor on CPU: the gloo channel (``workers.cluster.weights``,
what rollout actors use) against Ray's object store (``ray.put`` of one flat tensor, the
actor's ``ray.get``), between two Ray actors on two nodes of a local ``ray.cluster_utils``
cluster (loopback; each node has its own object store, so ``ray.get`` really transfers).

Each figure is the median over ``--reps`` pushes of the time from the learner starting a push
until the actor confirms it holds the weights (a Ray call's round trip included in both):
  push_<MB>MB_s   crucible = gloo broadcast of flat buckets; peer = ray.put + remote ray.get
Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_weight_push`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

from workers.cluster.weights import WeightChannel, flatten, layout_of

REPO = Path(__file__).resolve().parents[2]
MB = 1024 * 1024


@ray.remote(num_cpus=1, max_concurrency=4)
class End:
    """One end of the push: the learner (sends) or the actor (receives)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.channel: WeightChannel | None = None
        self.layout = None

    def endpoint(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def open(self, host: str, port: int, rank: int, size_mb: int) -> None:
        self.layout = layout_of({"w": torch.zeros(size_mb * MB // 4)})
        self.channel = WeightChannel(host, port, rank=rank, timeout_s=120)

    def recv_gloo(self) -> int:
        assert self.channel is not None and self.layout is not None
        return int(self.channel.recv(self.layout)[0].numel())

    def take(self, flat: torch.Tensor) -> int:
        return int(flat.numel())  # deserialised into this process: the weights are here

    def time_gloo(self, peer: object, reps: int) -> list[float]:
        assert self.channel is not None and self.layout is not None
        state = {"w": torch.randn(self.layout.buckets[0][1])}
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ref = peer.recv_gloo.remote()  # type: ignore[attr-defined]
            self.channel.send(flatten(state, self.layout))
            ray.get(ref)
            out.append(time.perf_counter() - t0)
        return out

    def time_put(self, peer: object, size_mb: int, reps: int) -> list[float]:
        state = {"w": torch.randn(size_mb * MB // 4)}
        layout = layout_of(state)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ref = ray.put(flatten(state, layout)[0])
            ray.get(peer.take.remote(ref))  # type: ignore[attr-defined]
            del ref
            out.append(time.perf_counter() - t0)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = max(args.sizes_mb) * 3 * MB + 100 * MB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 100 * MB, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
        cluster.wait_for_nodes()
        learner = End.options(scheduling_strategy="SPREAD").remote()  # type: ignore[attr-defined]
        actor = End.options(scheduling_strategy="SPREAD").remote()  # type: ignore[attr-defined]
        nodes = ray.get([learner.endpoint.remote(), actor.endpoint.remote()])
        print(f"learner and actor on nodes at {nodes[0][0]} and {nodes[1][0]} (loopback), "
              f"{args.reps} pushes per size, torch threads 1")
        for size in args.sizes_mb:
            host, port = ray.get(learner.endpoint.remote())
            ray.get([learner.open.remote(host, port, 0, size),
                     actor.open.remote(host, port, 1, size)])
            gloo = statistics.median(ray.get(learner.time_gloo.remote(actor, args.reps)))
            put = statistics.median(ray.get(learner.time_put.remote(actor, size, args.reps)))
            print(f"push_{size}MB_s: crucible={gloo:.6g} peer={put:.6g} "
                  f"ratio={gloo / put:.4f}  (crucible: gloo channel, peer: ray.put/get; "
                  f"gloo {size / gloo:.0f} MB/s, object store {size / put:.0f} MB/s)")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
