"""Launching training runs: QC-gated environment versions, several environments, optional
datasets, the base model (preset, directory, or a checkpoint of an earlier run, pinned at
launch), max_attempts, and the lineage all of it records."""

from __future__ import annotations

import pytest
from django.db.models import ProtectedError

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.lineage.models import LineageEdge
from apps.runs.models import Checkpoint, Run, RunEnvironment
from tests.factories import DatasetFactory, make_version, put_run_object

RUNS = "/api/v1/teams/acme/runs"
W = "/api/v1/worker"


@pytest.fixture
def envs(project):
    """Environment ``arith`` with v1 failed, v2 passed and v3 pending QC; ``code`` v1 passed."""
    system = Actor.system()
    arith = env_services.environment_create(actor=system, team=project.team, project=project,
                                            slug="arith")
    code = env_services.environment_create(actor=system, team=project.team, project=project,
                                           slug="code")
    versions = {}
    for n, (env, passed) in enumerate([(arith, False), (arith, True), (arith, None),
                                       (code, True)]):
        version, _ = env_services.version_create(actor=system, environment=env,
                                                 spec={"n": n})
        if passed is not None:
            env_services.record_qc(actor=system, version=version, passed=passed,
                                   report={"reason": "answers do not verify"} if not passed
                                   else {"reason": "ok"})
        versions[f"{env.slug}@v{version.number}"] = version
    return versions


@pytest.fixture
def sft(project):
    dataset = DatasetFactory(project=project, team=project.team, slug="sft")
    make_version(dataset, [{"prompt": "1 + 1 =", "completion": "2"}])
    dataset.refresh_from_db()
    return dataset


WARM = {"sft": {"steps": 1}}  # a pinned SFT dataset needs its phase on


def train(client, **overrides):
    body = {"project": "main", "kind": "train", "config": {}, **overrides}
    return client.post(RUNS, body, format="json")


# --- QC gate --------------------------------------------------------------------------------


def test_train_on_a_qc_failed_version_is_refused_naming_it_and_why(member, envs):
    count = Run.objects.count()
    r = train(member.client, environments=["arith@v1"])
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["code"] == "qc_not_passed"
    assert "arith@v1 failed QC: answers do not verify" in body["message"]
    assert body["errors"]["environments"] == ["arith@v1 failed QC: answers do not verify"]
    # The single-reference form is refused the same way, under its own key.
    single = train(member.client, environment="arith@v1")
    assert single.status_code == 400 and "environment" in single.json()["errors"]
    assert Run.objects.count() == count


def test_train_on_a_pending_version_is_refused_until_qc_passes(member, envs):
    r = train(member.client, environments=["arith@v3"])
    assert r.status_code == 400
    assert "arith@v3 has not passed QC (status pending); run QC on it first" in \
        r.json()["message"]
    preview = member.client.post(f"{RUNS}/preview", {"project": "main", "kind": "train",
                                                     "environments": ["arith@v3"]},
                                 format="json")
    assert preview.status_code == 400 and preview.json()["code"] == "qc_not_passed"


def test_profile_runs_may_use_pending_versions_but_not_failed_ones(member, envs, sft):
    ok = member.client.post(RUNS, {"project": "main", "kind": "profile", "datasets": ["sft"],
                                   "environment": "arith@v3"}, format="json")
    assert ok.status_code == 201, ok.content
    bad = member.client.post(RUNS, {"project": "main", "kind": "profile", "datasets": ["sft"],
                                    "environment": "arith@v1"}, format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "qc_not_passed"


def test_train_pins_several_passed_environments_and_datasets_with_lineage(member, envs, sft):
    r = train(member.client, environments=["arith@v2", "code"], datasets=["sft"],
              name="multi", config=WARM)
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["pool"] == "gpu" and body["max_attempts"] == 3 and body["attempts"] == []
    assert [e["environment"] for e in body["environments"]] == ["arith", "code"]
    assert body["environment"]["digest"] == envs["arith@v2"].digest  # the first one
    assert body["datasets"][0]["dataset"] == "sft"
    run = Run.objects.get(pk=body["id"])
    assert [p.environment_version for p in RunEnvironment.objects.filter(run=run)] == [
        envs["arith@v2"], envs["code@v1"]]
    sources = set(LineageEdge.objects.filter(target_type="run", target_id=str(run.pk))
                  .values_list("source_type", "source_id", "relation"))
    assert sources == {
        ("environment_version", envs["arith@v2"].digest, "environment"),
        ("environment_version", envs["code@v1"].digest, "environment"),
        ("dataset_version", sft.current_version.digest, "input"),
    }
    twice = train(member.client, environments=["arith@v2", "arith@v2"])
    assert twice.status_code == 400 and "pinned twice" in twice.json()["message"]


def test_the_frozen_config_names_only_what_the_run_uses(member, envs):
    """No phantom fields: the arithmetic task, a local checkpoint folder, an inline
    environment are not carried by a platform run that would not use them."""
    r = train(member.client, environments=["arith@v2"])
    assert r.status_code == 201, r.content
    config = r.json()["config"]
    assert "task" not in config and "environment" not in config
    assert "dir" not in config["checkpoint"] and config["checkpoint"]["keep"] == 2
    assert config["tokenizer"] == {"source": "train", "vocab_size": 96}
    assert Run.objects.get(pk=r.json()["id"]).config == config

    with_task = train(member.client, environments=["arith@v2"],
                      config={"task": {"max_operand": 5}})
    assert with_task.status_code == 400
    assert "config.task" in with_task.json()["message"]
    assert "arith@v2" in with_task.json()["message"]
    inline = train(member.client, config={"environment": {"source": "builtin",
                                                          "name": "arithmetic"}})
    assert inline.status_code == 400 and "pin it with 'environments'" in inline.json()["message"]
    local = train(member.client, config={"checkpoint": {"dir": "/tmp/mine"}})
    assert local.status_code == 400
    assert "checkpoint.dir is chosen by the worker" in local.json()["message"]
    # Without pinned environments the arithmetic task's settings are what it trains on: kept.
    own = train(member.client, config={"task": {"max_operand": 5}})
    assert own.status_code == 201 and own.json()["config"]["task"]["max_operand"] == 5
    assert Run.objects.count() == 2


def test_max_attempts_is_validated(member, project):
    assert train(member.client, max_attempts=5).json()["max_attempts"] == 5
    for bad in (0, 21, "many"):
        r = train(member.client, max_attempts=bad)
        assert r.status_code == 400, bad
        assert "max_attempts" in r.json()["errors"]


# --- base model -----------------------------------------------------------------------------


def _run_with_checkpoints(member, worker, object_store, steps=(2, 4)):
    """A train run (claimed, running) with checkpoints stored in the object store."""
    run_id = train(member.client).json()["id"]
    claimed = worker.post(f"{W}/claim", {"pool": "gpu", "worker_id": "w", "run_id": run_id},
                          format="json").json()
    headers = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    worker.post(f"{W}/runs/{run_id}/status", {"status": "running"}, format="json", **headers)
    for step in steps:
        uri = put_run_object(claimed, f"checkpoints/step-{step:06d}.tar", b"tar")
        r = worker.post(f"{W}/runs/{run_id}/checkpoints", {"step": step, "uri": uri},
                        format="json", **headers)
        assert r.status_code == 201, r.content
    return run_id, headers


def test_checkpoint_of_an_earlier_run_is_resolved_and_pinned(member, worker, object_store,
                                                             envs):
    parent, _ = _run_with_checkpoints(member, worker, object_store)
    latest = Checkpoint.objects.get(run_id=parent, step=4)
    r = train(member.client, base_model=f"run:{parent}", environments=["arith@v2"],
              config={"model": {"router_aux_loss_coef": 0.02}})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["base_model"] == {"checkpoint": latest.pk, "run": parent, "step": 4,
                                  "uri": latest.uri}
    # Frozen into the config: the object URI (workers fetch it) and the checkpoint's tokenizer.
    assert body["config"]["model"]["source"] == "path"
    assert body["config"]["model"]["path"] == latest.uri
    assert body["config"]["model"]["router_aux_loss_coef"] == 0.02
    assert body["config"]["tokenizer"] == {"source": "model"}  # no unused vocab_size
    child = Run.objects.get(pk=body["id"])
    assert child.base_checkpoint == latest
    assert LineageEdge.objects.filter(source_type="checkpoint", source_id=str(latest.pk),
                                      target_type="run", target_id=body["id"],
                                      relation="base_model").exists()

    # A given step, or a checkpoint id; the preview shows the same resolution.
    at2 = train(member.client, base_model=f"run:{parent}@2").json()
    assert at2["base_model"]["step"] == 2
    by_id = member.client.post(f"{RUNS}/preview", {
        "project": "main", "kind": "train", "base_model": f"checkpoint:{latest.pk}"},
        format="json").json()
    assert by_id["run"]["base_model"]["uri"] == latest.uri
    assert by_id["run"]["config"]["model"]["path"] == latest.uri
    # A checkpoint in use cannot be deleted from under the runs that start from it.
    assert list(latest.derived_runs.all()) == [child]
    with pytest.raises(ProtectedError):
        latest.delete()


@pytest.mark.parametrize("ref, needle", [
    ("run:00000000-0000-0000-0000-000000000000", "run '00000000-0000-0000-0000-000000000000' "
                                                 "not found"),
    ("run:not-a-uuid", "run 'not-a-uuid' not found"),
    ("run:nope@3", "run 'nope' not found"),
    ("checkpoint:999999", "matches no checkpoint"),
    ("PARENT@3", "matches no checkpoint"),
    ("gpt-4", "Unknown base_model"),
    ("path:relative/dir", "must be absolute"),
])
def test_bad_base_model_is_400_naming_it(member, worker, object_store, project, ref, needle):
    parent, _ = _run_with_checkpoints(member, worker, object_store)
    count = Run.objects.count()
    r = train(member.client, base_model=ref.replace("PARENT", f"run:{parent}"))
    assert r.status_code == 400, r.content
    assert needle in r.json()["message"] and "base_model" in r.json()["errors"]
    assert Run.objects.count() == count


def test_checkpoints_of_other_teams_are_unknown(member, worker, object_store, project,
                                                outsider):
    parent, _ = _run_with_checkpoints(member, worker, object_store)
    r = outsider.client.post("/api/v1/teams/rival/runs", {
        "project": "main", "kind": "train", "base_model": f"run:{parent}"}, format="json")
    # Their project does not exist either; the checkpoint lookup fails first, and says the
    # same as for a run that does not exist at all.
    assert r.status_code == 400 and "not found in team 'rival'" in r.json()["message"]


def test_checkpoint_outside_the_object_store_is_refused(member, worker, object_store, project):
    parent, headers = _run_with_checkpoints(member, worker, object_store, steps=())
    r = worker.post(f"{W}/runs/{parent}/checkpoints", {"step": 1, "uri": "file:///elsewhere/x"},
                    format="json", **headers)
    assert r.status_code == 400 and r.json()["code"] == "uri_outside_run"
    # A row from before URIs were confined is not followed either.
    Checkpoint.objects.create(run_id=parent, team=project.team, step=1, uri="file:///elsewhere/x")
    r = train(member.client, base_model=f"run:{parent}")
    assert r.status_code == 400 and r.json()["code"] == "uri_outside_run", r.content
    assert "does not lie under its run's own objects" in r.json()["message"]


def test_base_model_preset_path_and_conflicts(member, project, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MODEL_PATH_ROOTS": "/models"}
    preset = train(member.client, base_model="preset").json()
    assert preset["config"]["model"]["source"] == "preset" and preset["base_model"] is None
    path = train(member.client, base_model="/models/qwen3-moe",
                 config={"tokenizer": {"source": "model"}}).json()
    assert (path["config"]["model"]["source"], path["config"]["model"]["path"]) == (
        "path", "/models/qwen3-moe")
    both = train(member.client, base_model="preset", config={"model": {"source": "preset"}})
    assert both.status_code == 400 and "Give the base model once" in both.json()["message"]
    profile = member.client.post(RUNS, {"project": "main", "kind": "profile",
                                        "base_model": "preset"}, format="json")
    assert profile.status_code == 400 and "takes no base model" in profile.json()["message"]


# --- pinned training datasets --------------------------------------------------------------


def _dataset(project, slug, records):
    dataset = DatasetFactory(project=project, team=project.team, slug=slug)
    make_version(dataset, records)
    return dataset


def test_a_pinned_sft_dataset_needs_sft_steps(member, envs, sft):
    r = train(member.client, environments=["arith@v2"], datasets=["sft"])
    assert r.status_code == 400
    assert "pins SFT dataset(s) sft@v1 but sft.steps is 0" in r.json()["message"]


def test_preference_datasets_need_the_preference_phase_and_vice_versa(member, envs, project):
    _dataset(project, "prefs", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    r = train(member.client, environments=["arith@v2"], datasets=["prefs"])
    assert r.status_code == 400 and "preference.steps is 0" in r.json()["message"]
    r = train(member.client, environments=["arith@v2"], config={"preference": {"steps": 2}})
    assert r.status_code == 400 and "pins no preference dataset" in r.json()["message"]
    ok = train(member.client, environments=["arith@v2"], datasets=["prefs"],
               config={"preference": {"steps": 2}})
    assert ok.status_code == 201, ok.content
    assert ok.json()["config"]["preference"]["steps"] == 2


def test_a_dataset_of_another_shape_is_refused_naming_its_fields(member, envs, project):
    _dataset(project, "rows", [{"text": "hello", "label": 1}])
    r = train(member.client, environments=["arith@v2"], datasets=["rows"], config=WARM)
    assert r.status_code == 400
    message = r.json()["message"]
    assert "Dataset rows@v1 cannot be a training dataset" in message
    assert "its first record has label, text" in message
    # The same records become SFT pairs through templates.
    templated = {"sft": {"steps": 1, "prompt_template": "{text}:",
                         "completion_template": "{label}"}}
    ok = train(member.client, environments=["arith@v2"], datasets=["rows"], config=templated)
    assert ok.status_code == 201, ok.content


def test_sft_templates_may_only_read_record_fields(member, envs, sft):
    bad = {"sft": {"steps": 1, "prompt_template": "{x.__class__}",
                   "completion_template": "{y}"}}
    r = train(member.client, environments=["arith@v2"], datasets=["sft"], config=bad)
    assert r.status_code == 400 and "must be a record field" in r.json()["message"]
    half = {"sft": {"steps": 1, "prompt_template": "{x}"}}
    r = train(member.client, environments=["arith@v2"], datasets=["sft"], config=half)
    assert r.status_code == 400 and "set both" in r.json()["message"]


# --- lineage graph --------------------------------------------------------------------------


def test_lineage_graph_links_inputs_run_checkpoints_and_derived_runs(member, worker,
                                                                     object_store, envs, sft):
    r = train(member.client, environments=["arith@v2"], datasets=["sft"], config=WARM)
    parent = r.json()["id"]
    claimed = worker.post(f"{W}/claim", {"pool": "gpu", "worker_id": "w", "run_id": parent},
                          format="json").json()
    lease = claimed["lease_id"]
    uri = put_run_object(claimed, "checkpoints/step-000001.tar", b"tar")
    ckpt = worker.post(f"{W}/runs/{parent}/checkpoints", {"step": 1, "uri": uri},
                       format="json", HTTP_X_CRUCIBLE_LEASE=lease).json()
    child = train(member.client, base_model=f"checkpoint:{ckpt['id']}").json()["id"]

    graph = member.client.get("/api/v1/teams/acme/lineage",
                              {"artifact": f"checkpoint:{ckpt['id']}"}).json()
    edges = {(e["source"]["type"], e["source"]["id"], e["relation"], e["target"]["type"],
              e["target"]["id"]) for e in graph["edges"]}
    assert edges == {
        ("environment_version", envs["arith@v2"].digest, "environment", "run", parent),
        ("dataset_version", sft.current_version.digest, "input", "run", parent),
        ("run", parent, "produced", "checkpoint", str(ckpt["id"])),
        ("checkpoint", str(ckpt["id"]), "base_model", "run", child),
    }
