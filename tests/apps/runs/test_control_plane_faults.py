"""Riding out control-plane faults, in-process: a worker session keeps reporting while the API
is unreachable (its reports wait in the outbox and go out in order when the API returns, each
stored once), and a node agent's report of a dead worker's lease requeues the run at once.

The outage is injected in the transport in front of the real WSGI app (a dropped connection);
the real web process is stopped in tests/e2e/test_control_plane_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Run, RunAttempt, RunEvent
from workers.client import ApiError, CrucibleClient, WorkerSession
from workers.protocol import DeadLease, DeadLeaseReport

pytestmark = pytest.mark.django_db(transaction=True)  # the outbox sends from its own thread


class Outage(httpx.BaseTransport):
    """The real app behind a switch: while ``down`` is set, every request fails to connect."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner, self.down = inner, threading.Event()
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.down.is_set():
            self.refused += 1
            raise httpx.ConnectError("connection refused (injected outage)", request=request)
        return self.inner.handle_request(request)


@pytest.fixture(autouse=True)
def var_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))


def _stream_seqs(run_id: str) -> list[int]:
    events = RunEvent.objects.filter(run_id=run_id).values_list("seq", flat=True)
    batches = MetricBatch.objects.filter(run_id=run_id).values_list("stream_seq", flat=True)
    return sorted([*events, *batches])


def test_reports_made_during_an_outage_are_delivered_in_order_once(api, wsgi, worker_token,
                                                                   qa):
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    outage = Outage(wsgi)
    with CrucibleClient("http://testserver", worker_token, transport=outage,
                        backoff=0.05) as pool:
        session = pool.claim("cpu", "w-outage", run_id=run["id"])
        assert isinstance(session, WorkerSession)
        session.set_status("running")
        session.log_metrics([{"name": "loss", "step": 1, "value": 1.0}])
        session.log_event("before the outage")

        outage.down.set()
        started = time.monotonic()
        for step in range(2, 7):
            assert session.log_metrics([{"name": "loss", "step": step, "value": 1.0 / step}]) \
                == {"buffered": True}
            assert session.log_event(f"step {step} during the outage") == {"buffered": True}
        session.add_samples([{"step": 6, "prompt": "p", "completion": "c"}])
        # The engine was not held up for the outage: only the first report tried briefly.
        assert time.monotonic() - started < 10
        assert session.buffering and not session.lease_lost
        assert MetricPoint.objects.filter(run_id=run["id"]).count() == 1

        outage.down.clear()
        # A status change waits for the outbox, so it never overtakes what is queued.
        assert session.set_status("succeeded") == {"status": "succeeded"}
        assert not session.buffering
        session.close()
    assert outage.refused > 0
    steps = list(MetricPoint.objects.filter(run_id=run["id"]).order_by("id")
                 .values_list("step", flat=True))
    assert steps == [1, 2, 3, 4, 5, 6]
    messages = list(RunEvent.objects.filter(run_id=run["id"], kind="log").order_by("seq")
                    .values_list("message", flat=True))
    assert messages == ["before the outage"] + [f"step {s} during the outage"
                                                for s in range(2, 7)]
    seqs = _stream_seqs(run["id"])
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, nothing twice
    assert Run.objects.get(pk=run["id"]).status == "succeeded"


class Slow(httpx.BaseTransport):
    """The real app, each metric batch taking ``delay`` seconds longer to answer."""

    def __init__(self, inner: httpx.BaseTransport, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/metrics"):
            time.sleep(self.delay)
        return self.inner.handle_request(request)


def test_flush_waits_for_a_backlog_longer_than_the_lease_while_heartbeats_renew_it(
        api, wsgi, worker_token, qa, monkeypatch):
    """A backlog that takes longer to deliver than one lease period is delivered whole, as
    long as heartbeats keep the lease: flush's deadline follows the renewed lease."""
    import workers.client as client_module

    monkeypatch.setattr(client_module, "MIN_RETRY_S", 0.2)
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    outage = Outage(Slow(wsgi, delay=0.1))
    with CrucibleClient("http://testserver", worker_token, transport=outage,
                        backoff=0.05) as pool:
        session = pool.claim("cpu", "w-backlog", run_id=run["id"])
        assert isinstance(session, WorkerSession)
        session.lease_s = 1.5  # as the client sees it; heartbeats every 0.2 s renew it
        outage.down.set()
        batches = 30  # >= 3 s of delivery at 0.1 s each: twice the lease period
        for step in range(batches):
            assert session.log_metrics([{"name": "loss", "step": step, "value": 1.0}]) \
                == {"buffered": True}
        session.start_heartbeat(interval=0.2)
        outage.down.clear()
        started = time.monotonic()
        session.flush()  # raised LeaseLost after one lease period before
        assert time.monotonic() - started > session.lease_s
        assert not session.buffering and not session.lease_lost
        session.stop_heartbeat()
    assert MetricPoint.objects.filter(run_id=run["id"]).count() == batches


def test_a_dead_workers_lease_reported_by_its_node_agent_requeues_the_run(
        api, pool, wsgi, member, qa):
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    session = pool.claim("cpu", "host-a:4242", run_id=run["id"])
    assert session is not None
    session.set_status("running")

    # Only operator tokens speak for a node; a lease that is not the run's changes nothing.
    with CrucibleClient("http://testserver", member.token, transport=wsgi, retries=0) as user:
        with pytest.raises(ApiError) as refused:
            user.report_dead_leases("host-a", DeadLeaseReport(leases=[DeadLease(
                run=run["id"], lease_id=session.lease_id)]))
        assert refused.value.status == 403
    stale = pool.report_dead_leases("host-a", DeadLeaseReport(leases=[DeadLease(
        run=run["id"], lease_id="an-older-lease", worker="host-a:1", pid=1)]))
    assert stale == {"released": [], "ignored": [run["id"]]}
    assert Run.objects.get(pk=run["id"]).status == "running"

    answer = pool.report_dead_leases("host-a", DeadLeaseReport(leases=[DeadLease(
        run=run["id"], lease_id=session.lease_id, worker="host-a:4242", pid=4242)]))
    assert answer == {"released": [run["id"]], "ignored": []}
    again = Run.objects.get(pk=run["id"])
    assert again.status == "queued" and again.lease_id == ""
    attempt = RunAttempt.objects.get(run_id=run["id"], number=1)
    assert attempt.outcome == "lost" and "host-a:4242 died" in attempt.error
    # Reported twice (the agent retried): nothing more happens.
    assert pool.report_dead_leases("host-a", DeadLeaseReport(leases=[DeadLease(
        run=run["id"], lease_id=session.lease_id)]))["ignored"] == [run["id"]]
    # Another worker takes it over as attempt 2.
    second = pool.claim("cpu", "host-b:7", run_id=run["id"])
    assert second is not None and second.run.attempt == 2


def test_the_node_agent_reports_the_lease_file_of_a_dead_worker_process(api, pool, qa,
                                                                        tmp_path):
    """A worker process that held a run's lease died without a word (its lease file stays):
    one look of the agent requeues the run and removes the file; a live holder's file stays."""
    from workers import liveness
    from workers.agent import Agent, describe_host

    doomed = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    alive = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    dead_session = pool.claim("cpu", "host-a:1", run_id=doomed["id"])
    live_session = pool.claim("cpu", "host-a:2", run_id=alive["id"])
    assert dead_session is not None and live_session is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = liveness.lease_dir()
    (folder / f"{gone.pid}-{doomed['id']}.json").write_text(json.dumps({
        "pid": gone.pid, "started": "", "run": doomed["id"], "lease_id": dead_session.lease_id,
        "worker": "host-a:1"}))
    agent = Agent(pool, describe_host({"CRUCIBLE_NODE_NAME": "host-a"}), interval=60)
    with liveness.holding(alive["id"], live_session.lease_id, "host-a:2") as mine:
        assert agent.check_leases() == [doomed["id"]]
        assert mine is not None and mine.exists()
        assert [h.run_id for h in liveness.held_leases()] == [alive["id"]]
    assert Run.objects.get(pk=doomed["id"]).status == "queued"
    assert Run.objects.get(pk=alive["id"]).status == "claimed"
    assert agent.check_leases() == []
