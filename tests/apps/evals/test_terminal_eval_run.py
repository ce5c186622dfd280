"""An eval run on a terminal environment version, executed by the real eval adapter: the
worker plays each task in sandbox sessions with the run's endpoint policy (a scripted
OpenAI-compatible server over real HTTP), leaves out the tasks QC quarantined, and stores the
same report, metrics and samples as for any environment."""

from __future__ import annotations

import json

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.environments.models import EnvironmentVersion
from apps.runs.models import Run, RunEvent, Sample
from tests.skips import sandbox_unavailable
from tests.workers.envs.chat_server import chat_server
from tests.workers.envs.test_terminal_eval import SOLVE, solver, tasks
from workers.adapters import eval as eval_adapter

pytestmark = pytest.mark.django_db


def test_an_eval_run_plays_terminal_tasks(project, api, pool, object_store, monkeypatch):
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("OBJECT_STORE_URL", object_store.url)  # the worker's store is the web's
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="answers")
    spec = {"env": {"source": "terminal",
                    "tasks": [t.model_dump(mode="json") for t in tasks()]}}
    version, _ = env_services.version_create(actor=Actor.system(), environment=env, spec=spec)
    # a QC report that quarantined the second task (as the QC adapter stores it)
    EnvironmentVersion.objects.filter(pk=version.pk).update(
        qc_status="passed", qc_report={"quarantined_ids": ["unsolved"]})
    with chat_server(solver) as server:
        run = api.launch_run("acme", project="main", kind="eval", environment="answers@v1",
                             config={"policy": {"kind": "endpoint", "base_url": server.url,
                                                "model": "scripted"}})
        session = pool.claim("cpu", "w1", run_id=run["id"])
        eval_adapter.run(session)
    stored = Run.objects.get(pk=run["id"])
    report = json.loads(object_store.get_bytes(stored.report_uri))
    assert report["schema"] == "crucible.eval/1" and report["environment"]["name"] == "answers"
    assert [r["task_id"] for r in report["tasks"]] == ["solve"]
    assert report["summary"]["pass_at"] == {"1": 1.0} and report["summary"]["errors"] == 0
    assert report["tasks"][0]["turns"] == 3.0
    assert report["policy"]["source"] == {"kind": "endpoint", "base_url": server.url}
    samples = list(Sample.objects.filter(run_id=run["id"]))
    assert len(samples) == 1 and samples[0].prompt == SOLVE and samples[0].reward == 1.0
    assert samples[0].reward_components == {"hidden_tests": 1.0}
    assert '"name": "write_file"' in samples[0].completion
    done = [e for e in RunEvent.objects.filter(run_id=run["id"]) if "eval done" in e.message]
    assert done and "pass@1=1.000" in done[0].message


def test_a_preset_model_on_terminal_tasks_is_refused_with_the_reason(project, api, pool):
    from workers.adapters.common import JobError

    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="answers")
    env_services.version_create(actor=Actor.system(), environment=env, spec={"env": {
        "source": "terminal", "tasks": [tasks()[0].model_dump(mode="json")]}})
    run = api.launch_run("acme", project="main", kind="eval", environment="answers@v1",
                         base_model="preset")
    session = pool.claim("cpu", "w1", run_id=run["id"])
    with pytest.raises(JobError, match="holds terminal tasks: evaluate an endpoint"):
        eval_adapter.run(session)
