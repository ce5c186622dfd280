"""A Celery worker with a pool of two processes gives each its thread allotment (the usable cores
over the two of them, with no setting), says so in its log at start, and a train run on it
reports the torch threads it really ran with in its first event."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import tenant, wait_for
from workers import threads
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(600)]

TINY = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                "eval_samples": 1},
    "checkpoint": {"save_final": False},
}


def test_prefork_worker_processes_take_and_report_their_allotment(live_server, start_worker,
                                                                  tmp_path, monkeypatch):
    for name in (threads.SETTING, threads.SHARERS, *threads.LIBRARY_VARS):
        monkeypatch.delenv(name, raising=False)  # the worker decides from its own pool
    token, worker_token = tenant("th")
    log = tmp_path / "worker.log"
    worker = start_worker(worker_token, queues="gpu", log=log, pool=("-P", "prefork", "-c", "2"))
    expect = max(1, threads.usable_cores() // 2)

    def both_children_started() -> list[str]:
        assert worker.poll() is None, log.read_text()[-3000:]
        found = re.findall(r"crucible worker process \d+: threads: (\d+) per process",
                           log.read_text())
        return found if len(found) == 2 else []

    assert wait_for(both_children_started, timeout=180, what="two pool processes") == \
        [str(expect)] * 2
    assert "2 process(es) sharing them" in log.read_text()

    with CrucibleClient(live_server.url, token) as client:
        run = client.launch_run("th", project="demo", kind="train", config=TINY)
        done = client.wait_for_run("th", run["id"], timeout=400)
        assert done["status"] == "succeeded", (done["error"], log.read_text()[-3000:])
        events = client.run_events("th", run["id"])["results"]
    started = next(e for e in events if "config" in e["message"] and "threads" in e["data"])
    assert started["data"]["threads"]["torch_threads"] == expect
    assert started["data"]["threads"]["OMP_NUM_THREADS"] == str(expect)
    assert f"{expect} torch thread(s) per rank" in started["message"]


def test_a_prefork_worker_runs_a_train_run_with_its_rollout_process(live_server, start_worker,
                                                                     tmp_path):
    """The async actor in its own process (`trainer.async_actor = "process"`) is spawned from
    a Celery prefork pool process, trains, and is gone when the run ends."""
    token, worker_token = tenant("rp")
    log = tmp_path / "worker.log"
    worker = start_worker(worker_token, queues="gpu", log=log, pool=("-P", "prefork", "-c", "1"))
    config = {**TINY, "trainer": {**TINY["trainer"], "steps": 3, "max_async_steps": 1,
                                  "async_actor": "process"}}
    with CrucibleClient(live_server.url, token) as client:
        run = client.launch_run("rp", project="demo", kind="train", config=config)
        done = client.wait_for_run("rp", run["id"], timeout=400)
        assert done["status"] == "succeeded", (done["error"], log.read_text()[-3000:])
        points = client.run_metrics("rp", run["id"], names=["async/lag1", "loss"])
    assert worker.poll() is None, log.read_text()[-3000:]
    series = {s["name"]: s["points"] for s in points["series"]}
    assert [p["step"] for p in series["loss"]] == [1, 2, 3] and series["async/lag1"]
    spawned = [p for p in psutil_children(worker.pid) if "multiprocessing.spawn" in p]
    assert not spawned, f"a rollout process outlived its run: {spawned}"


def psutil_children(pid: int) -> list[str]:
    """Command lines of every process below `pid` (from /proc: no psutil needed)."""
    import os

    kids: dict[int, list[int]] = {}
    cmd: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(cmd.get(p, ""))
        todo.extend(kids.get(p, []))
    return out
