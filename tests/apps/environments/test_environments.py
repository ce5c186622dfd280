"""Environments API: versions registered from validated specs (built-in, uploaded tasks),
errors naming the field, QC and eval runs launched per version, a QC report setting the
version's status through the worker API, the QC gate of training, and eval reports per
version."""

from __future__ import annotations

import json

import pytest

from apps.environments.models import EnvironmentVersion
from apps.runs.models import Run
from tests.factories import put_run_object

ENVS = "/api/v1/teams/acme/environments"
RUNS = "/api/v1/teams/acme/runs"
W = "/api/v1/worker"

ARITH = {"env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}}
TASKS = {"env": {"source": "tasks",
                 "tasks": [{"id": "q1", "prompt": "What is 1/2 + 1/4?", "answer": "3/4",
                            "split": "eval"},
                           {"id": "q2", "prompt": "What is 2 + 2?", "answer": "4"}],
                 "rubric": {"components": [{"name": "correct", "checker": "math_equiv"}]}},
         "description": "two fractions"}


@pytest.fixture
def env(member, project):
    r = member.client.post(ENVS, {"slug": "arith", "project": "main"}, format="json")
    assert r.status_code == 201, r.content
    return f"{ENVS}/arith/versions"


def register(member, versions, spec):
    return member.client.post(versions, {"spec": spec}, format="json")


def test_builtin_version_is_normalised_and_content_addressed(member, env):
    r = register(member, env, ARITH)
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["number"] == 1 and len(body["digest"]) == 64
    assert body["qc_status"] == "pending" and body["blocked"] is False
    assert body["spec"] == {"env": {"source": "builtin", "name": "arithmetic",
                                    "params": {"eval_size": 4}}, "description": ""}
    # The bare source object is the same environment: same digest, no new version.
    again = register(member, env, ARITH["env"])
    assert again.status_code == 200 and again.json()["digest"] == body["digest"]
    other = register(member, env, {"source": "builtin", "name": "arithmetic"})
    assert other.status_code == 201 and other.json()["number"] == 2
    assert other.json()["digest"] != body["digest"]
    listed = member.client.get(env).json()["results"]
    assert [v["number"] for v in listed] == [2, 1]
    detail = member.client.get(f"{env}/{body['digest'][:12]}").json()
    assert detail["digest"] == body["digest"]


def test_uploaded_tasks_version_keeps_its_tasks_and_rubric(member, env):
    r = register(member, env, TASKS)
    assert r.status_code == 201, r.content
    spec = r.json()["spec"]
    assert [t["id"] for t in spec["env"]["tasks"]] == ["q1", "q2"]
    assert spec["env"]["rubric"]["components"][0]["checker"] == "math_equiv"
    assert spec["env"]["interaction"]["mode"] == "single_turn"  # defaults filled in
    assert spec["description"] == "two fractions"


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"source": "builtin", "name": "nope"}, "spec.env.builtin", "unknown built-in"),
    ({"source": "builtin", "name": "arithmetic", "params": {"opz": ["+"]}},
     "spec.env.builtin.opz", "Extra inputs"),
    ({"source": "tasks", "tasks": [{"id": "a", "prompt": "p"}],
      "rubric": {"components": [{"name": "c", "checker": "fuzzy"}]}},
     "spec.env.tasks.rubric.components.0.checker", "unknown checker 'fuzzy'"),
    ({"source": "tasks", "tasks": [{"id": "a", "prompt": "p"}, {"id": "a", "prompt": "q"}],
      "rubric": {"components": [{"name": "c", "checker": "exact_match"}]}},
     "spec.env.tasks", "used twice"),
    ({"source": "verifiers", "module": "not a module"}, "spec.env.verifiers.module",
     "dotted Python module"),
    ({"source": "docker"}, "spec.env", "source"),
])
def test_bad_specs_are_refused_naming_the_field_and_nothing_is_written(member, env, spec,
                                                                      field, words):
    r = register(member, env, spec)
    assert r.status_code == 400, r.content
    errors = r.json()["errors"]
    key = next((k for k in errors if k.startswith(field)), None)
    assert key is not None, errors
    assert any(words in m for m in errors[key]), errors
    assert not EnvironmentVersion.objects.exists()


def _claim(worker, run_id: str, pool: str) -> dict:
    r = worker.post(f"{W}/claim", {"pool": pool, "worker_id": "w1", "run_id": run_id},
                    format="json")
    assert r.status_code == 200, r.content
    lease = {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}
    assert worker.post(f"{W}/runs/{run_id}/status", {"status": "running"},
                       **lease).status_code == 200
    return lease


def _qc_report(passed: bool) -> dict:
    return {"schema": "crucible.qc/1", "passed": passed, "blocked": not passed,
            "block_reasons": [] if passed else ["quarantined 3 of 4 tasks (75%) > 10%"],
            "summary": {"tasks": 4, "quarantined": 0 if passed else 3},
            "quarantined_ids": [] if passed else ["1", "2", "3"],
            "tasks": [{"task_id": str(i)} for i in range(4)]}


def test_qc_run_report_sets_the_status_and_a_blocked_version_is_refused_for_training(
        member, worker, env):
    digest = register(member, env, ARITH).json()["digest"]
    r = member.client.post(f"{env}/v1/qc", {"config": {"qc": {"repeats": 1}}}, format="json")
    assert r.status_code == 201, r.content
    run = r.json()
    assert run["kind"] == "qc" and run["pool"] == "sandbox"
    assert Run.objects.get(pk=run["id"]).config == {"qc": {**run["config"]["qc"]}}
    lease = _claim(worker, run["id"], "sandbox")
    claimed = worker.get(f"{W}/runs/{run['id']}", **lease).json()
    assert claimed["environments"][0]["digest"] == digest

    outside = worker.post(f"{W}/runs/{run['id']}/qc",
                          {"report": _qc_report(False), "uri": "file:///x/qc.json"},
                          format="json", **lease)
    assert outside.status_code == 400 and outside.json()["code"] == "uri_outside_run"
    qc_uri = put_run_object(claimed, "qc-report.json", b"{}")
    r = worker.post(f"{W}/runs/{run['id']}/qc", {"report": _qc_report(False), "uri": qc_uri},
                    format="json", **lease)
    assert r.status_code == 200 and r.json()["qc_status"] == "failed", r.content
    version = member.client.get(f"{env}/v1").json()
    assert version["blocked"] is True
    assert version["blocked_reason"] == "quarantined 3 of 4 tasks (75%) > 10%"
    assert version["qc_report"]["run"] == run["id"]
    assert "tasks" not in version["qc_report"]  # per-task rows stay in the stored report
    assert version["qc_report"]["quarantined_ids"] == ["1", "2", "3"]

    refused = member.client.post(RUNS, {"project": "main", "kind": "train", "config": {},
                                        "environments": ["arith@v1"]}, format="json")
    assert refused.status_code == 400 and refused.json()["code"] == "qc_not_passed"
    assert "quarantined 3 of 4 tasks" in refused.json()["errors"]["environments"][0]

    # QC again (a qc run may pin a failed version) and pass: training may use it.
    again = member.client.post(f"{env}/v1/qc", {"pool": "cpu"}, format="json").json()
    lease = _claim(worker, again["id"], "cpu")
    again_uri = put_run_object(Run.objects.get(pk=again["id"]), "qc-report.json", b"{}")
    r = worker.post(f"{W}/runs/{again['id']}/qc",
                    {"report": _qc_report(True), "uri": again_uri},
                    format="json", **lease)
    assert r.json()["qc_status"] == "passed"
    ok = member.client.post(RUNS, {"project": "main", "kind": "train", "config": {},
                                   "environments": ["arith@v1"]}, format="json")
    assert ok.status_code == 201, ok.content


def test_qc_report_endpoint_needs_the_lease_and_a_qc_run(member, worker, env):
    register(member, env, ARITH)
    run = member.client.post(f"{env}/v1/qc", {}, format="json").json()
    uri = put_run_object(Run.objects.get(pk=run["id"]), "qc-report.json", b"{}")
    body = {"report": _qc_report(True), "uri": uri}
    assert worker.post(f"{W}/runs/{run['id']}/qc", body, format="json").status_code == 409
    lease = _claim(worker, run["id"], "sandbox")
    bad = worker.post(f"{W}/runs/{run['id']}/qc", {"report": {"x": 1}, "uri": uri},
                      format="json", **lease)
    assert bad.status_code == 400 and "passed" in bad.json()["message"]
    assert member.client.get(f"{env}/v1").json()["qc_status"] == "pending"
    ev = member.client.post(f"{env}/v1/eval", {"base_model": "preset"}, format="json").json()
    lease = _claim(worker, ev["id"], "cpu")
    wrong = worker.post(f"{W}/runs/{ev['id']}/qc", body, format="json", **lease)
    assert wrong.status_code == 400 and "not a QC run" in wrong.json()["message"]


def test_qc_report_is_refused_under_a_wrong_or_expired_lease(member, worker, env):
    from datetime import timedelta

    from django.utils import timezone

    register(member, env, ARITH)
    run = member.client.post(f"{env}/v1/qc", {}, format="json").json()
    body = {"report": _qc_report(True),
            "uri": put_run_object(Run.objects.get(pk=run["id"]), "qc-report.json", b"{}")}
    lease = _claim(worker, run["id"], "sandbox")
    url = f"{W}/runs/{run['id']}/qc"
    wrong = worker.post(url, body, format="json", HTTP_X_CRUCIBLE_LEASE="not-the-lease")
    assert wrong.status_code == 409 and wrong.json()["code"] == "lease_invalid"
    Run.objects.filter(pk=run["id"]).update(lease_expires_at=timezone.now()
                                            - timedelta(seconds=1))
    late = worker.post(url, body, format="json", **lease)
    assert late.status_code == 409 and late.json()["code"] == "lease_expired"
    assert member.client.get(f"{env}/v1").json()["qc_status"] == "pending"


def test_eval_launch_validates_the_policy(member, env):
    register(member, env, ARITH)
    none = member.client.post(f"{env}/v1/eval", {}, format="json")
    assert none.status_code == 400 and "exactly one policy" in none.content.decode()
    k = member.client.post(f"{env}/v1/eval", {"base_model": "preset",
                                              "config": {"k": [2]}}, format="json")
    assert k.status_code == 400 and "samples_per_task" in k.content.decode()
    endpoint = {"kind": "endpoint", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    both = member.client.post(f"{env}/v1/eval", {"base_model": "preset",
                                                 "config": {"policy": endpoint}},
                              format="json")
    assert both.status_code == 400
    ok = member.client.post(RUNS, {"project": "main", "kind": "eval", "environment": "arith",
                                   "config": {"policy": endpoint, "samples_per_task": 2,
                                              "k": [1, 2]}}, format="json")
    assert ok.status_code == 201, ok.content
    assert ok.json()["pool"] == "cpu"
    preset = member.client.post(f"{env}/v1/eval", {"base_model": "preset"}, format="json")
    assert preset.status_code == 201, preset.content
    assert preset.json()["config"]["model"]["source"] == "preset"
    unpinned = member.client.post(RUNS, {"project": "main", "kind": "eval",
                                         "config": {"policy": endpoint}}, format="json")
    assert unpinned.status_code == 400 and "environment" in unpinned.json()["errors"]


def test_eval_reports_are_listed_per_version(member, worker, env):
    register(member, env, ARITH)
    run = member.client.post(f"{env}/v1/eval", {"base_model": "preset", "name": "base"},
                             format="json").json()
    lease = _claim(worker, run["id"], "cpu")
    report = {"schema": "crucible.eval/1", "policy": {"name": "policy"}, "split": "eval",
              "k": [1], "summary": {"tasks": 4, "mean_reward": 0.25, "pass_at": {"1": 0.25}}}
    uri = put_run_object(Run.objects.get(pk=run["id"]), "eval-report.json",
                         json.dumps(report).encode())
    assert worker.post(f"{W}/runs/{run['id']}/artifacts", {"kind": "report", "uri": uri},
                       format="json", **lease).status_code == 200
    assert member.client.get(f"{env}/v1/evals").json() == []  # not succeeded yet
    worker.post(f"{W}/runs/{run['id']}/status", {"status": "succeeded"}, **lease)
    rows = member.client.get(f"{env}/v1/evals").json()
    assert [(r["run"], r["name"], r["summary"]["pass_at"]["1"]) for r in rows] == [
        (run["id"], "base", 0.25)]


def test_synthesize_launch_validates_its_config(member, project):
    bad = member.client.post(RUNS, {"project": "main", "kind": "synthesize",
                                    "config": {"synthesis": {"generators": [{"kind": "math"}]}}},
                             format="json")
    assert bad.status_code == 400 and "config.dataset" in bad.json()["errors"]
    typo = member.client.post(RUNS, {"project": "main", "kind": "synthesize", "config": {
        "dataset": "arith", "synthesis": {"generators": [{"kind": "math", "cnt": 3}]}}},
        format="json")
    assert typo.status_code == 400
    assert any("cnt" in k for k in typo.json()["errors"]), typo.json()
    ok = member.client.post(RUNS, {"project": "main", "kind": "synthesize", "config": {
        "dataset": "arith", "synthesis": {"generators": [{"kind": "math", "count": 3}]}}},
        format="json")
    assert ok.status_code == 201, ok.content
    assert ok.json()["pool"] == "cpu"
    keyed = member.client.post(RUNS, {"project": "main", "kind": "synthesize", "config": {
        "dataset": "arith", "synthesis": {"generators": [{"kind": "model", "endpoint": {
            "base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key": "sk-secret"}}]}}},
        format="json")
    assert keyed.status_code == 400 and "api_key" in keyed.json()["message"]
    assert "sk-secret" not in keyed.content.decode()


TERMINAL = {"env": {"source": "terminal", "tasks": [{
    "id": "answer", "instruction": "Write 42 to answer.txt.",
    "hidden_tests": {"test_answer.py": "from pathlib import Path\n\n\ndef test_answer():\n"
                                       "    assert Path('/work/answer.txt').read_text()"
                                       ".strip() == '42'\n"},
    "reference": "echo 42 > answer.txt",
    "limits": {"memory_mb": 256, "disk_mb": 32, "pids": 64, "cpu_s": 60, "wall_s": 900,
               "idle_s": 300}}]}}


def test_terminal_tasks_register_and_take_qc_eval_and_train_runs(member, env):
    r = register(member, env, TERMINAL)
    assert r.status_code == 201, r.content
    task = r.json()["spec"]["env"]["tasks"][0]
    assert task["max_turns"] == 20 and task["split"] == "train"  # normalised: defaults filled
    qc = member.client.post(f"{env}/v1/qc", {"config": {"qc": {"repeats": 2}}}, format="json")
    assert qc.status_code == 201, qc.content
    assert qc.json()["kind"] == "qc"
    endpoint = {"kind": "endpoint", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    ev = member.client.post(f"{env}/v1/eval", {"config": {"policy": endpoint}}, format="json")
    assert ev.status_code == 201, ev.content  # the eval driver plays terminal episodes
    assert ev.json()["kind"] == "eval"
    assert ev.json()["config"]["policy"]["base_url"] == endpoint["base_url"]
    train = member.client.post(RUNS, {"project": "main", "kind": "train", "config": {},
                                      "environments": ["arith@v1"]}, format="json")
    assert train.status_code == 400 and train.json()["code"] == "qc_not_passed"
    assert register(member, env, ARITH).status_code == 201  # v2: single-turn arithmetic
    # as a passing QC report sets it (the report path is tested above)
    EnvironmentVersion.objects.update(qc_status="passed")
    train = member.client.post(RUNS, {"project": "main", "kind": "train", "config": {},
                                      "environments": ["arith@v1"]}, format="json")
    assert train.status_code == 201, train.content  # the RL engine plays terminal episodes
    mixed = member.client.post(RUNS, {"project": "main", "kind": "train", "config": {},
                                      "environments": ["arith@v1", "arith@v2"]}, format="json")
    assert mixed.status_code == 400, mixed.content
    assert "train alone" in mixed.json()["message"]


@pytest.mark.parametrize("spec, field", [
    ({"source": "terminal"}, "spec.env.terminal"),
    ({"source": "terminal", "tasks": []}, "spec.env.terminal"),
    ({"source": "terminal", "tasks": [{**TERMINAL["env"]["tasks"][0], "files": {
        "../escape": "x"}}]}, "spec.env.terminal.tasks.0.files"),
    ({"source": "terminal", "tasks": [TERMINAL["env"]["tasks"][0]] * 2}, "spec.env.terminal"),
])
def test_bad_terminal_specs_name_the_field(member, env, spec, field):
    r = register(member, env, spec)
    assert r.status_code == 400, r.content
    assert any(k.startswith(field) for k in r.json()["errors"]), r.json()
    assert not EnvironmentVersion.objects.exists()
