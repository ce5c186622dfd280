"""Allow-lists for what runs make workers reach: endpoint hosts/CIDRs and model-path roots,
refused at launch with the reason and checked again by the worker before it connects or
reads. (No test here sends a packet beyond loopback: refusals happen before any connect.)"""

from __future__ import annotations

import pytest

from workers.adapters import eval as eval_adapter
from workers.adapters.common import JobError
from workers.adapters.train import prepare_train

RUNS = "/api/v1/teams/acme/runs"
ENVS = "/api/v1/teams/acme/environments"


def _allow(settings, **values: str) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, **values}


@pytest.fixture
def arith(member, project):
    member.client.post(ENVS, {"slug": "arith", "project": "main"}, format="json")
    r = member.client.post(f"{ENVS}/arith/versions", {"spec": {"env": {
        "source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}}}, format="json")
    assert r.status_code == 201, r.content
    return "arith"


def _eval(member, base_url: str):
    body = {"project": "main", "kind": "eval", "environment": "arith",
            "config": {"policy": {"kind": "endpoint", "base_url": base_url, "model": "m"}}}
    return member.client.post(RUNS, body, format="json")


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata
    "http://[fe80::1]:8000/v1",
    "http://10.0.0.5:8000/v1",
    "http://192.168.1.10/v1",
    "http://[::ffff:169.254.169.254]/v1",
    "ftp://127.0.0.1/v1",
])
def test_eval_endpoints_outside_the_allow_list_are_refused_at_launch(member, arith, url):
    r = _eval(member, url)
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["code"] in ("not_allowed", "invalid")
    if body["code"] == "not_allowed":
        assert "config.policy.base_url" in body["errors"]
        assert "CRUCIBLE_ENDPOINT_ALLOW" in body["message"]


def test_loopback_is_allowed_by_default_and_the_operator_widens_the_list(member, arith,
                                                                         settings):
    assert _eval(member, "http://127.0.0.1:9/v1").status_code == 201
    assert _eval(member, "http://localhost:9/v1").status_code == 201
    assert _eval(member, "http://10.0.0.5:8000/v1").status_code == 400
    _allow(settings, ENDPOINT_ALLOW="10.0.0.0/8,models.example.com,*.inference.example.com")
    assert _eval(member, "http://10.0.0.5:8000/v1").status_code == 201
    assert _eval(member, "https://models.example.com/v1").status_code == 201
    assert _eval(member, "https://a.inference.example.com/v1").status_code == 201
    assert _eval(member, "https://inference.example.com.evil/v1").status_code == 400
    assert _eval(member, "http://169.254.169.254/").status_code == 400


def test_synthesis_generator_endpoints_are_checked_too(member, project):
    member.client.post("/api/v1/teams/acme/datasets", {"slug": "synth", "project": "main"},
                       format="json")
    body = {"project": "main", "kind": "synthesize", "config": {
        "dataset": "synth", "synthesis": {"name": "s", "seed": 1, "generators": [
            {"kind": "model", "count": 1, "endpoint": {
                "base_url": "http://169.254.169.254/v1", "model": "m"}}]}}}
    r = member.client.post(f"{RUNS}/preview", body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "not_allowed"
    assert "config.synthesis.generators[0].endpoint.base_url" in r.json()["errors"]


@pytest.mark.parametrize("ref", ["path:/etc", "/root/.ssh", "path:/models/../etc",
                                 "path:/modelsX/a"])
def test_model_paths_outside_the_roots_are_refused(member, project, settings, ref):
    _allow(settings, MODEL_PATH_ROOTS="/models")
    r = member.client.post(f"{RUNS}/preview", {"project": "main", "kind": "train",
                                               "base_model": ref}, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "not_allowed" and "CRUCIBLE_MODEL_PATH_ROOTS" in \
        r.json()["message"]


def test_no_model_directory_is_allowed_until_roots_are_configured(member, project, settings):
    body = {"project": "main", "kind": "train", "base_model": "path:/models/qwen"}
    refused = member.client.post(f"{RUNS}/preview", body, format="json")
    assert refused.status_code == 400 and "none configured" in refused.json()["message"]
    config_path = {"project": "main", "kind": "train",
                   "config": {"model": {"source": "path", "path": "/etc"}}}
    assert member.client.post(f"{RUNS}/preview", config_path,
                              format="json").json()["code"] == "not_allowed"
    _allow(settings, MODEL_PATH_ROOTS="/models,/srv/hf")
    assert member.client.post(f"{RUNS}/preview", body, format="json").status_code == 200


# --- the worker checks again, with its own environment ---------------------------------------


def test_the_worker_refuses_a_model_path_its_own_roots_do_not_hold(
        project, settings, api, pool, object_store, tmp_path, monkeypatch):
    _allow(settings, MODEL_PATH_ROOTS=str(tmp_path))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    run = api.launch_run("acme", project="main", kind="train", base_model=f"path:{model_dir}")
    session = pool.claim("gpu", "w1", run_id=run["id"])
    monkeypatch.delenv("CRUCIBLE_MODEL_PATH_ROOTS", raising=False)
    with pytest.raises(JobError, match="CRUCIBLE_MODEL_PATH_ROOTS"):
        prepare_train(session, object_store, tmp_path / "work")
    # A symlink out of an allowed root is followed to where it really points.
    monkeypatch.setenv("CRUCIBLE_MODEL_PATH_ROOTS", str(tmp_path / "roots"))
    (tmp_path / "roots").mkdir()
    (tmp_path / "roots" / "sneaky").symlink_to("/etc")
    from workers import egress
    with pytest.raises(egress.EgressRefused):
        egress.check_model_path(str(tmp_path / "roots" / "sneaky"), egress.model_roots_from_env())
    monkeypatch.setenv("CRUCIBLE_MODEL_PATH_ROOTS", str(tmp_path))
    spec, _ = prepare_train(session, object_store, tmp_path / "work2")
    assert spec.model.path == str(model_dir)


def test_the_worker_refuses_an_endpoint_its_own_list_does_not_hold(
        arith, api, pool, monkeypatch):
    """The web allows loopback (the default); this worker allows only ::1, so it refuses
    127.0.0.1 before connecting (were the check broken, the call would go to 127.0.0.1:9)."""
    run = api.launch_run("acme", project="main", kind="eval", environment="arith", config={
        "policy": {"kind": "endpoint", "base_url": "http://127.0.0.1:9/v1", "model": "m"}})
    session = pool.claim("cpu", "w1", run_id=run["id"])
    monkeypatch.setenv("CRUCIBLE_ENDPOINT_ALLOW", "::1/128")
    with pytest.raises(JobError, match="CRUCIBLE_ENDPOINT_ALLOW"):
        eval_adapter.run(session)
