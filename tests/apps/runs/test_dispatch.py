"""A launch sends its Celery message only once its transaction commits: a worker that got
the message before the commit would claim a run it cannot see yet, and a rolled-back launch
must leave no message for a run that never existed. ``app.send_task`` is the broker edge;
a recorder stands in for it."""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
from django.db import transaction

from apps.core.exceptions import InvalidInput
from apps.projects.models import Project
from apps.runs.dispatch import EXECUTE_TASK
from apps.runs.models import Run
from config.celery import app
from tests.django_fixtures import Caller
from tests.factories import DatasetFactory, make_run, make_version

Capture = Callable[..., AbstractContextManager[list[Callable[[], None]]]]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every ``send_task`` call, as its name and keyword options."""
    calls: list[dict[str, Any]] = []

    def record(name: str, args: list[Any] | None = None, **options: Any) -> None:
        calls.append({"name": name, "args": args, **options})

    monkeypatch.setattr(app, "send_task", record)
    return calls


def test_a_launch_sends_one_message_only_after_commit(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        run = make_run(project, priority=3)
        assert sent == []
    assert sent == [{"name": EXECUTE_TASK, "args": [str(run.pk)], "queue": "cpu",
                     "priority": 3}]


def test_a_launch_through_the_api_sends_after_its_commit(
        member: Caller, project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        r = member.client.post("/api/v1/teams/acme/runs",
                               {"project": "main", "kind": "profile", "datasets": ["qa"],
                                "config": {}}, format="json")
        assert r.status_code == 201, r.content
    assert sent == []
    for callback in callbacks:  # the commit: the send and the live-stream publishes
        callback()
    assert sent == [{"name": EXECUTE_TASK, "args": [r.json()["id"]], "queue": "cpu",
                     "priority": 0}]


def test_a_rolled_back_launch_sends_nothing(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    class Abort(Exception):
        """Raised inside the launch's transaction to roll it back."""

    with (django_capture_on_commit_callbacks(execute=True) as callbacks,
          pytest.raises(Abort), transaction.atomic()):
        make_run(project)
        raise Abort
    assert callbacks == []
    assert sent == []
    assert not Run.objects.exists()


def test_a_refused_launch_sends_nothing(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    with (django_capture_on_commit_callbacks(execute=True) as callbacks,
          pytest.raises(InvalidInput)):
        make_run(project, datasets=["missing"])
    assert callbacks == []
    assert sent == []


def test_the_local_worker_consumes_its_pools_and_its_node_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``manage.py up``'s worker takes runs the scheduler placed on this host: the queue it
    adds is the one dispatch sends to, for the name the agent registers."""
    from apps.runs.management.commands.up import worker_queues
    from workers.client import node_name

    monkeypatch.setenv("CRUCIBLE_NODE_NAME", "box-1.lan")
    assert worker_queues(node_name()) == "gpu,sandbox,cpu,node.box-1.lan"
    monkeypatch.delenv("CRUCIBLE_NODE_NAME")
    assert node_name() == socket.gethostname()
