"""Issue 20's end-to-end proof: preemption by checkpoint on a real (small) cluster.

Every part is a real process, configured by environment variables as in production: the web
server (uvicorn serving the ASGI app, with ``CRUCIBLE_SCHEDULER=1`` and the preemption knobs set
small), three node agents (``python -m workers.agent``) with 2 fake GPUs each, a Celery worker
with the beat (admission passes and lease sweeps) and, on each node, a Celery worker that
consumes that node's queue (``node.<name>``, where the scheduler sends what it placed there)
and trains tiny models; the workers and agents talk to the server over HTTP only, and a
browser (Playwright driving Debian's chromium) reads the pages a person would.

The story:

1. Staff put two teams in one cohort: ``alpha`` is guaranteed 4 of the 6 GPUs, ``beta`` 2, and
   beta's runs are ``preemptible`` by default.
2. The cluster fills, one run of 2 GPUs per node (a run that spans nodes would be a Ray job:
   docs/cluster.md): alpha's ``steady`` run; beta's ``keeper`` (class ``default``, within
   beta's quota) and beta's ``borrower`` (``preemptible``), whose 2 GPUs are alpha's idle
   quota, borrowed. The cluster page shows every GPU's holder and both teams' use against
   their quota.
3. Alpha launches a ``production`` run that needs 2 GPUs: alpha is reclaiming its own quota,
   so the scheduler asks the borrower (borrowed, and the lowest priority) to checkpoint and
   stop; it does (cooperatively, at its
   next heartbeat: the only checkpoint it has is the one it writes as it stops), goes back to
   the queue with ``preemptions`` 1 and the attempt given back, and waits for quota while the
   production run holds its GPUs. Its page says so.
4. The production run succeeds; the borrower is admitted again and resumes from that
   checkpoint: its metric steps continue the numbering, every step once, none twice.

To read the waiting borrower's page without racing the production run, the worker of the
borrower's node is shut down (warm: a worker finishes its task first) as soon as it has
started: the production run, admitted in the borrower's place, then holds its GPUs but waits
for a worker until the test starts new ones there. The long runs (``steady``, ``keeper`` and
the borrower) are canceled by their owners at the end, so nothing depends on how fast this
machine trains.

Runs on both configurations: filesystem broker + SQLite, and Redis + PostgreSQL.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.db import connection

from apps.core.actor import Actor
from apps.metrics.models import MetricPoint
from apps.runs import services as run_services
from apps.runs.models import Run
from apps.teams.models import Role
from apps.teams.services import personal_token_create, worker_token_create
from tests.browser.conftest import browser  # noqa: F401 - the fixture, found by name
from tests.browser.test_run_charts import PASSWORD, login
from tests.e2e.conftest import ROOT, purge_queues, wait_for
from tests.e2e.test_node_agents import start_agent
from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory
from workers.client import CrucibleClient
from workers.protocol import node_queue

# Three training processes import torch in turn on a shared machine: minutes when it is busy.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

FLAVOR = "fake-A100"  # the GPU type the agents report (tests/e2e/test_node_agents.py)
# Names of their own per test run: the broker keeps node queues between runs.
NODES = tuple(f"node-{i}-{uuid.uuid4().hex[:6]}" for i in (1, 2, 3))
LONG = 100_000  # steps: runs that only end when their owner cancels them
NO_PERIODIC = 1_000_000  # checkpoint.every: the only checkpoint is the preemption's
# A tiny GRPO run: one layer, two prompts of two completions per step.
TINY = {"model": {"preset": {"num_layers": 1}}, "sft": {"steps": 0},
        "rollout": {"group_size": 2, "max_new_tokens": 2},
        "trainer": {"prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                    "eval_samples": 1}}


def config(steps: int, checkpoint_every: int) -> dict:
    return {**TINY, "trainer": {**TINY["trainer"], "steps": steps},
            "checkpoint": {"every": checkpoint_every, "keep": 2}}


def resources() -> dict:
    return {"gpus_per_node": 2, "nodes": 1, "cpus": 0.25, "memory_gb": 0.25}


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def database_url() -> str:
    """The test database (pytest-django's), as the server process's ``DATABASE_URL``."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The server, agents and workers of one test; each writes its output to its own log."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = self.token = ""
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        with self.log(name).open("ab") as out:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def server(self, token: str, settings: dict[str, str]) -> str:
        """The web server on a free port, with ``settings`` as its environment; returns its
        URL once it answers."""
        port = free_port()
        env = {**os.environ, "DATABASE_URL": database_url(),
               "OBJECT_STORE_URL": django_settings.OBJECT_STORE_URL, "PYTHONUNBUFFERED": "1",
               **settings}
        proc = self.start("web", [sys.executable, "-m", "uvicorn", "config.asgi:application",
                                  "--host", "127.0.0.1", "--port", str(port),
                                  "--log-level", "warning"], env)
        self.url, self.token = f"http://127.0.0.1:{port}", token

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited:\n{tail(self.log('web'))}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=90, what="the server to answer")
        return self.url

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def agent(self, name: str) -> None:
        self.procs[name] = start_agent(self.url, self.token, name, self.log(name))

    def worker(self, name: str, queues: str, *, beat: bool = False, node: str = "",
               pool: str = "solo") -> subprocess.Popen:
        """A Celery worker, on ``node`` if given (it claims as that node); ``pool="prefork"``
        for one that stops taking messages at once on SIGTERM and exits when its task is done
        (a solo worker still takes the next message first)."""
        env = {**os.environ, "CRUCIBLE_API_URL": self.url, "CRUCIBLE_WORKER_TOKEN": self.token,
               "CRUCIBLE_NODE_NAME": node,
               "OBJECT_STORE_URL": django_settings.OBJECT_STORE_URL,
               "PYTHONUNBUFFERED": "1", "CRUCIBLE_THREAD_SHARERS": "3",
               # SIGTERM below must let the borrower's task run on (until the scheduler stops
               # it), not drain it: Celery's plain warm shutdown.
               "CRUCIBLE_DRAIN": "0",
               # The beat: an admission pass every second, lease sweeps every two.
               "CRUCIBLE_SCHEDULER": "1", "CRUCIBLE_ADMISSION_SECONDS": "1",
               "CRUCIBLE_SWEEP_SECONDS": "2"}
        env.pop("DATABASE_URL", None)  # workers hold no database credentials
        command = [sys.executable, "-m", "celery", "-A", "config.celery", "worker", "-Q",
                   queues, "-P", pool, "-c", "1", "-n", f"{name}@%h", "--without-gossip",
                   "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"]
        if beat:
            command += ["-B", "-s", str(self.folder / "beat-schedule")]
        return self.start(name, command, env)

    def wait(self, predicate, timeout: float, what: str):
        """``wait_for``, with every process's latest output in the message if it times out."""
        try:
            return wait_for(predicate, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{tail(self.log(name))}" for name in self.procs)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def world(transactional_db):
    """Two teams with a member each, and ``ops``: staff, admin of both (the browser's user,
    whose password is hashed as the server hashes them: the test's fast hasher is the test
    process's setting, not the server's)."""
    out = {}
    hasher = PBKDF2PasswordHasher()
    ops = UserFactory(username="ops", is_staff=True)
    ops.password = hasher.encode(PASSWORD, hasher.salt())
    ops.save(update_fields=["password"])
    for slug, member in (("alpha", "alice"), ("beta", "bob")):
        team = TeamFactory(slug=slug, name=slug.title())
        user = UserFactory(username=member)
        MembershipFactory(team=team, user=user, role=Role.MEMBER)
        MembershipFactory(team=team, user=ops, role=Role.ADMIN)
        ProjectFactory(team=team, slug="rl")
        out[member] = personal_token_create(actor=Actor.of_user(user), user=user,
                                            name="e2e")[1]
    out["ops"] = personal_token_create(actor=Actor.of_user(ops), user=ops, name="e2e")[1]
    out["operator"] = worker_token_create(actor=Actor.system(), team=None, name="cluster")[1]
    return out


def all_events(client: CrucibleClient, team: str, run_id: str) -> list[dict]:
    """Every event of the run, oldest first (the API pages them)."""
    events: list[dict] = []
    after = 0
    while True:
        page = client.run_events(team, run_id, after=after)
        events += page["results"]
        if not page["more"]:
            return events
        after = page["last_seq"]


def statuses(events: list[dict]) -> list[str]:
    """The run's status history: each transition is an event of kind ``status``."""
    return [e["data"]["status"] for e in events if e["kind"] == "status"]


def in_order(texts: list[str], *prefixes: str) -> bool:
    """Whether ``texts`` has one starting with each prefix, in that order."""
    rest = iter(texts)
    return all(any(t.startswith(p) for t in rest) for p in prefixes)


def reward_steps(run_id: str) -> list[int]:
    return sorted(s for (s,) in MetricPoint.objects.filter(
        run_id=run_id, name="reward_mean").values_list("step"))


def test_a_production_run_preempts_a_borrowed_run_which_resumes_from_its_checkpoint(
        browser, world, tmp_path):  # noqa: F811 - the fixture
    pytest.importorskip("deepspeed")
    purge_queues()
    procs = Processes(tmp_path)
    server = procs.server(world["operator"], {
        "CRUCIBLE_SCHEDULER": "1",
        # Heartbeats every 5 s: that is how soon a victim hears it should stop.
        "CRUCIBLE_LEASE_SECONDS": "15",
        # A victim may be preempted after a second of running (the default is 10 minutes);
        # it gets two minutes to stop by itself before its lease would be revoked.
        "CRUCIBLE_PREEMPT_MIN_RUNTIME_S": "1", "CRUCIBLE_PREEMPT_GRACE_S": "120"})
    alice = CrucibleClient(server, world["alice"])
    bob = CrucibleClient(server, world["bob"])
    ops = CrucibleClient(server, world["ops"])

    def node_worker(node: str, suffix: str = "") -> None:
        procs.worker(f"worker-{node}{suffix}", node_queue(node), node=node, pool="prefork")

    try:
        # 1. The cluster: three agents, 2 fake GPUs each, a worker on each; two teams'
        # queues in one cohort.
        for name in NODES:
            procs.agent(name)
        procs.wait(lambda: len(ops.get("cluster/nodes")["results"]) == 3, timeout=90,
                   what="three agents to register")
        nodes = ops.get("cluster/nodes")["results"]
        assert {(n["name"], n["gpu_type"], n["gpu_count"], n["state"]) for n in nodes} == {
            (name, FLAVOR, 2, "ready") for name in NODES}
        for team, nominal, default in (("alpha", 4, "default"), ("beta", 2, "preemptible")):
            queue = ops.request("PUT", f"teams/{team}/queue", json={
                "cohort": "lab", "nominal": {FLAVOR: nominal}, "default_priority": default})
            assert queue["configured"] and queue["nominal"] == {FLAVOR: nominal}
        procs.worker("control", "cpu", beat=True)
        for name in NODES:
            node_worker(name)

        # 2. Two teams fill the cluster; beta borrows 2 of alpha's idle GPUs.
        steady = alice.launch_run("alpha", project="rl", kind="train", name="steady",
                                  config=config(LONG, NO_PERIODIC), resources=resources())
        keeper = bob.launch_run("beta", project="rl", kind="train", name="keeper",
                                priority_class="default", config=config(LONG, NO_PERIODIC),
                                resources=resources())
        borrower = bob.launch_run("beta", project="rl", kind="train", name="borrower",
                                  config=config(LONG, NO_PERIODIC), resources=resources())
        assert (steady["priority_class"], keeper["priority_class"],
                borrower["priority_class"]) == ("default", "default", "preemptible")

        def running(team: str, run_id: str, client: CrucibleClient) -> dict | None:
            run = client.run(team, run_id)
            if run["status"] in ("failed", "succeeded", "canceled") or run["attempts"] and \
                    run["attempts"][0]["outcome"] == "failed":
                raise AssertionError(f"{run['name']} ended: {run['status']} {run['attempts']}")
            return run if run["status"] == "running" else None

        steady = procs.wait(lambda: running("alpha", steady["id"], alice), timeout=300,
                            what="the steady run to start")
        keeper = procs.wait(lambda: running("beta", keeper["id"], bob), timeout=300,
                            what="the keeper to start")
        borrower = procs.wait(lambda: running("beta", borrower["id"], bob), timeout=300,
                              what="the borrower to start")
        sid, kid, bid = steady["id"], keeper["id"], borrower["id"]
        (steady_node,) = steady["allocation"]
        (keeper_node,) = keeper["allocation"]
        borrowed_nodes = sorted(borrower["allocation"])
        assert len({steady_node, keeper_node, *borrowed_nodes}) == 3
        held = [(node, gpu) for run in (steady, keeper, borrower)
                for node, gpus in run["allocation"].items() for gpu in gpus]
        assert sorted(held) == sorted((n, g) for n in NODES for g in (0, 1))  # all 6, once
        # The worker of the borrower's node is asked to shut down (warm: it stops taking
        # messages now and exits once the borrower's task is done): whatever is admitted in
        # the borrower's place then waits for a worker the test starts, so the borrower's wait
        # can be read at leisure.
        for name in borrowed_nodes:
            procs.procs[f"worker-{name}"].terminate()

        # A few steps before it is asked to make room (it has no checkpoint yet).
        procs.wait(lambda: running("beta", bid, bob) and len(reward_steps(bid)) >= 3,
                   timeout=300, what="the borrower's first steps")
        assert bob.run_checkpoints("beta", bid) == []

        # The cluster page: who holds which GPU, and each team's use of its quota.
        page, errors = login(browser, server, "ops")
        page.goto(f"{server}/cluster/")
        assert page.locator(".gpu-slot.held").count() == 6
        for node in NODES:
            row = page.locator(f'tr[data-node="{node}"]')
            holder = {steady_node: sid, keeper_node: kid}.get(node, bid)
            assert [row.locator(".gpu-slot").nth(i).get_attribute("title")
                    for i in (0, 1)] == [f"GPU {i}: run {holder[:8]}" for i in (0, 1)]
            assert row.locator(".holders").inner_text() == holder[:8]
        queues = {t: page.locator(f'tr[data-queue="{t}"]') for t in ("alpha", "beta")}
        assert queues["alpha"].locator(".in-use").inner_text() == f"{FLAVOR} 2"
        assert queues["beta"].locator(".in-use").inner_text() == f"{FLAVOR} 4"  # 2 borrowed
        assert "lab" in queues["beta"].inner_text() and f"{FLAVOR} 2" in \
            queues["beta"].inner_text()

        # 3. Alpha needs its quota back for a production run.
        uid = alice.launch_run("alpha", project="rl", kind="train", name="urgent",
                               priority_class="production", config=config(3, NO_PERIODIC),
                               resources=resources())["id"]

        def requeued() -> dict | None:
            run = bob.run("beta", bid)
            if run["status"] in ("failed", "succeeded", "canceled"):
                raise AssertionError(f"the borrower ended: {run['status']}")
            # Queued again, and a pass has said why it waits.
            return run if run["status"] == "queued" and run["preemptions"] == 1 and \
                run["wait_reason"] else None

        procs.wait(requeued, timeout=180, what="the borrower to stop and requeue")
        for name in borrowed_nodes:
            worker = f"worker-{name}"
            assert procs.procs[worker].wait(timeout=60) == 0, tail(procs.log(worker))
        borrower = bob.run("beta", bid)

        # The borrower was asked to stop for the production run, checkpointed the step it had
        # done, stopped by itself (not at the deadline) and was queued again: not a failure,
        # its attempt given back.
        steps_before = reward_steps(bid)
        assert steps_before == list(range(1, len(steps_before) + 1))
        (stop,) = bob.run_checkpoints("beta", bid)
        assert stop["resumable"] and stop["step"] == steps_before[-1], (stop, steps_before)
        events = all_events(bob, "beta", bid)
        messages = [e["message"] for e in events]
        asked = [m for m in messages if m.startswith("preemption requested:")]
        assert len(asked) == 1 and f"reclaim quota (for run {uid})" in asked[0], messages
        assert statuses(events) == ["queued", "claimed", "running", "preempted", "queued"]
        assert in_order(messages, "preemption requested:",
                        f"checkpoint at step {stop['step']}",
                        f"preempted: stopped after step {stop['step']}, checkpointed",
                        "preempted: preempted by the scheduler (stopped)",
                        "queued: requeued after preemption 1"), messages
        assert borrower["attempt"] == 1 and borrower["error"] == ""
        assert [(a["outcome"], a["error"]) for a in borrower["attempts"]] == [
            ("preempted", "preempted by the scheduler (stopped)")]
        assert run_services.attempts_left(Run.objects.get(pk=bid)) == borrower["max_attempts"]
        # It waits for quota: alpha uses its whole nominal, so it lends nothing now.
        assert borrower["allocation"] == {}
        assert (borrower["wait_reason"], borrower["queue_position"]) == ("quota", 1)
        # The production run holds GPUs on a node the borrower left, waiting for a worker.
        urgent = alice.run("alpha", uid)
        assert urgent["status"] == "queued" and urgent["wait_reason"] == ""
        (urgent_node, urgent_gpus), = urgent["allocation"].items()
        assert urgent_node in borrowed_nodes and urgent_gpus == [0, 1]
        pending = {q["queue"]: q for q in ops.get("cluster/queue")["queues"]}
        assert (pending["alpha"]["admitted"], pending["beta"]["pending"]) == (1, 1), pending
        assert [(r["id"], r["wait_reason"]) for r in pending["beta"]["runs"]] == [
            (bid, "quota")]

        # The borrower's page, as its team reads it while it waits.
        page.goto(f"{server}/t/beta/runs/{bid}/")
        assert page.inner_text("#run-status") == "queued"
        wait_text = page.inner_text("#run-wait")
        assert wait_text.startswith("Waiting for the scheduler: quota"), wait_text
        assert "position 1 in its queue" in wait_text and "class preemptible" in wait_text
        assert "Preempted 1 time by the scheduler" in page.inner_text("#run-head")
        # The page lists the latest events: the preemption, between the run's start and its
        # return to the queue.
        shown = page.locator("#events .msg").all_inner_texts()
        assert in_order(shown, "running", f"preemption requested: reclaim quota (for run {uid})",
                        "preempted: preempted by the scheduler (stopped)",
                        "queued: requeued after preemption 1"), shown
        assert page.locator("#attempts tbody tr").count() == 1
        assert "preempted by the scheduler (stopped)" in page.inner_text("#attempts")

        page.goto(f"{server}/cluster/")
        assert page.locator(f'tr[data-node="{urgent_node}"] .holders').inner_text() == uid[:8]
        assert page.locator(f'tr[data-node="{steady_node}"] .holders').inner_text() == sid[:8]
        assert page.locator(f'tr[data-node="{keeper_node}"] .holders').inner_text() == kid[:8]
        assert page.locator(".gpu-slot.held").count() == 6
        assert queues["alpha"].locator(".in-use").inner_text() == f"{FLAVOR} 4"
        assert queues["beta"].locator(".in-use").inner_text() == f"{FLAVOR} 2"  # the keeper

        # 4. Workers come back: the production run runs and succeeds, then the borrower
        # resumes (on the same node: the only one free of the steady run and the keeper).
        for name in borrowed_nodes:
            node_worker(name, "-again")
        try:
            done = alice.wait_for_run("alpha", uid, timeout=300)
        except TimeoutError:
            raise AssertionError(procs.logs()) from None
        assert done["status"] == "succeeded", (done["error"], procs.logs())

        def resumed_and_progressed() -> bool:
            run = running("beta", bid, bob)
            return bool(run) and run["attempt"] == 2 and \
                len(reward_steps(bid)) >= len(steps_before) + 3

        procs.wait(resumed_and_progressed, timeout=300,
                   what="the borrower to resume and train on")
        assert sorted(bob.run("beta", bid)["allocation"]) == borrowed_nodes
        for run_id, client, team in ((bid, bob, "beta"), (kid, bob, "beta"),
                                     (sid, alice, "alpha")):
            assert client.cancel_run(team, run_id)["status"] == "canceled"
        # Their workers notice at their next report and stop (no more points after that).
        for worker in (f"worker-{steady_node}", f"worker-{keeper_node}",
                       f"worker-{borrowed_nodes[0]}-again"):
            procs.wait(lambda w=worker: "'stopped'" in tail(procs.log(w)), timeout=120,
                       what=f"{worker} to stop its canceled run")

        # It resumed from the checkpoint it wrote as it stopped...
        events = all_events(bob, "beta", bid)
        messages = [e["message"] for e in events]
        assert statuses(events) == ["queued", "claimed", "running", "preempted", "queued",
                                    "claimed", "running", "canceled"]
        resumed = [m for m in messages if m.startswith("attempt 2: resuming from the checkpoint")]
        assert len(resumed) == 1 and resumed[0].startswith(
            f"attempt 2: resuming from the checkpoint at step {stop['step']} ("), resumed
        # ... and its steps continue the numbering: every step once per series, none twice.
        points = list(MetricPoint.objects.filter(run_id=bid).values_list("name", "step"))
        assert [k for k, n in Counter(points).items() if n > 1] == []
        steps = reward_steps(bid)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) > len(steps_before)
        through_api = bob.run_metrics("beta", bid, names=["reward_mean"], after_step=0,
                                      max_points=5_000)
        (series,) = through_api["series"]
        assert [p["step"] for p in series["points"]] == steps and not series["more"]

        borrower = bob.run("beta", bid)
        assert borrower["preemptions"] == 1 and borrower["attempt"] == 2
        assert [a["outcome"] for a in borrower["attempts"]] == ["preempted", "canceled"]

        # The page tells the story after the fact.
        page.goto(f"{server}/t/beta/runs/{bid}/")
        assert page.inner_text("#run-status") == "canceled"
        assert page.locator("#run-wait").count() == 0
        assert "Preempted 1 time by the scheduler" in page.inner_text("#run-head")
        shown = page.locator("#events .msg").all_inner_texts()
        assert in_order(shown, "preemption requested:",
                        "preempted: preempted by the scheduler (stopped)",
                        "queued: requeued after preemption 1", "claimed:", "running",
                        f"attempt 2: resuming from the checkpoint at step {stop['step']}",
                        "canceled:"), shown
        assert page.locator("#attempts tbody tr").count() == 2
        assert errors == []
    finally:
        for client in (alice, bob, ops):
            client.close()
        procs.stop_all()
