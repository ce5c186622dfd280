"""The live run stream over real websockets (Channels), with replay on reconnect."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from config.asgi import application
from tests.factories import DatasetFactory, make_run
from tests.skips import host_reason

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[3]


def _claim(worker, run):
    body = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w",
                                                 "run_id": str(run.pk)}).json()
    return {"HTTP_X_CRUCIBLE_LEASE": body["lease_id"]}


def _post_batch(worker, run, lease, seq, start):
    points = [{"name": "loss", "step": s, "value": float(s)} for s in range(start, start + 5)]
    r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics", {"seq": seq, "points": points},
                    **lease)
    assert r.status_code == 200, r.content


async def _receive(comm, count, timeout=5.0):
    """Exactly ``count`` messages, then silence (a timeout inside receive would kill the
    consumer, so quietness is checked with receive_nothing)."""
    out = [await comm.receive_json_from(timeout=timeout) for _ in range(count)]
    assert await comm.receive_nothing(timeout=0.3), "more messages than expected"
    return out


def _connect(path, token):
    return WebsocketCommunicator(application, path,
                                 headers=[(b"authorization", f"Bearer {token}".encode())])


def test_stream_replays_then_pushes_live_and_resumes_without_gaps(member, project, worker):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    lease = _claim(worker, run)  # events: queued (1), claimed (2)
    path = f"/ws/teams/acme/runs/{run.pk}/stream"

    async def scenario():
        comm = _connect(path, member.token)
        connected, _ = await comm.connect()
        assert connected
        backlog = await _receive(comm, 2)
        assert [m["seq"] for m in backlog] == [1, 2]
        assert backlog[1]["kind"] == "status" and backlog[1]["data"]["status"] == "claimed"

        await sync_to_async(_post_batch)(worker, run, lease, 1, 0)
        await sync_to_async(worker.post)(f"/api/v1/worker/runs/{run.pk}/status",
                                         {"status": "running"}, **lease)
        live = await _receive(comm, 2)
        assert [m["seq"] for m in live] == [3, 4]
        assert live[0]["type"] == "metrics" and live[0]["steps"] == [0, 1, 2, 3, 4]
        assert live[1]["data"]["status"] == "running"
        await comm.disconnect()

        # While disconnected: two more batches and an event.
        await sync_to_async(_post_batch)(worker, run, lease, 2, 5)
        await sync_to_async(_post_batch)(worker, run, lease, 3, 10)
        await sync_to_async(worker.post)(f"/api/v1/worker/runs/{run.pk}/events",
                                         {"events": [{"message": "halfway"}]}, **lease)

        again = _connect(f"{path}?after=4", member.token)
        assert (await again.connect())[0]
        missed = await _receive(again, 3)
        assert [m["seq"] for m in missed] == [5, 6, 7]
        assert missed[0]["steps"] == [5, 6, 7, 8, 9] and missed[1]["steps"][0] == 10
        assert missed[2]["message"] == "halfway"
        # A retried batch (same seq) is stored once and not streamed twice.
        await sync_to_async(_post_batch)(worker, run, lease, 3, 10)
        assert await again.receive_nothing(timeout=0.5)
        await again.disconnect()

    async_to_sync(scenario)()


def test_a_large_batch_is_announced_then_sent_whole_from_the_database(member, project,
                                                                     worker):
    """A batch over ``INLINE_POINTS`` crosses the channel layer as a summary; the listener
    still gets every point, in order, live, once."""
    from apps.metrics.services import INLINE_POINTS

    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    lease = _claim(worker, run)  # events: queued (1), claimed (2)
    size = INLINE_POINTS * 2 + 3
    columns = {"name": [f"m{i % 3}" for i in range(size)], "step": list(range(size)),
               "value": [i / 7 for i in range(size)]}

    async def scenario():
        comm = _connect(f"/ws/teams/acme/runs/{run.pk}/stream", member.token)
        assert (await comm.connect())[0]
        assert [m["seq"] for m in await _receive(comm, 2)] == [1, 2]
        r = await sync_to_async(worker.post)(f"/api/v1/worker/runs/{run.pk}/metrics",
                                             {"seq": 1, "columns": columns}, **lease)
        assert r.status_code == 200, r.content
        await sync_to_async(_post_batch)(worker, run, lease, 2, size)  # small: inline
        big, small = await _receive(comm, 2)
        assert big["seq"] == 3 and "summary" not in big
        assert big["names"] == columns["name"] and big["steps"] == columns["step"]
        assert big["values"] == columns["value"]
        assert small["seq"] == 4 and small["steps"] == list(range(size, size + 5))
        await comm.disconnect()

    async_to_sync(scenario)()


def test_non_members_and_anonymous_are_refused(outsider, viewer, project):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    path = f"/ws/teams/acme/runs/{run.pk}/stream"

    async def scenario():
        comm = _connect(path, outsider.token)
        connected, code = await comm.connect()
        assert not connected and code == 4404
        anonymous = WebsocketCommunicator(application, path,
                                          headers=[(b"origin", b"http://localhost")])
        connected, _ = await anonymous.connect()
        assert not connected
        bad = _connect(path, "crc_nope_nope")
        assert not (await bad.connect())[0]
        reader = _connect(path, viewer.token)  # viewers may watch
        assert (await reader.connect())[0]
        await reader.disconnect()

    async_to_sync(scenario)()


def test_team_stream_pushes_status_changes(member, project, worker):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))

    async def scenario():
        comm = _connect("/ws/teams/acme/runs", member.token)
        assert (await comm.connect())[0]
        await sync_to_async(_claim)(worker, run)
        message = await comm.receive_json_from(timeout=2)
        assert message == {**message, "type": "run_status", "run": str(run.pk),
                           "status": "claimed"}
        await comm.disconnect()

    async_to_sync(scenario)()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("REDIS_URL"),
                    reason=host_reason("cross-process streaming needs the Redis channel "
                                       "layer (REDIS_URL)"))
def test_stream_crosses_web_processes_through_redis(live_server, member, project, worker):
    """A worker posts to one web process (the live server); a client watches through
    another (a uvicorn subprocess); Redis carries the message between them."""
    import websockets.sync.client as ws_client

    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    lease = _claim(worker, run)
    port = _free_port()
    db = settings.DATABASES["default"]
    env = {**os.environ, "DATABASE_URL":
           f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"}
    web = subprocess.Popen([sys.executable, "-m", "uvicorn", "config.asgi:application",
                            "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "second web process did not start"
                time.sleep(0.2)
        url = f"ws://127.0.0.1:{port}/ws/teams/acme/runs/{run.pk}/stream?after=2"
        with ws_client.connect(url, additional_headers={
                "Authorization": f"Bearer {member.token}"}) as conn:
            time.sleep(0.5)  # the consumer has joined its group
            _post_batch(worker, run, lease, 1, 0)
            message = json.loads(conn.recv(timeout=10))
            assert message["seq"] == 3 and message["steps"] == [0, 1, 2, 3, 4]
    finally:
        web.terminate()
        web.wait(timeout=10)
