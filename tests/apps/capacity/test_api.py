"""``/api/v1/teams/<team>/capacity``: the catalog, plans from a preset, a pasted config and a
checkpoint's saved config.json (a real tar in the test's object store), and the 400s a
person gets for configs and numbers the planner cannot use."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from apps.runs.models import Checkpoint, Run
from tests.factories import make_run, put_run_object
from workers.capacity import PRESETS

pytestmark = pytest.mark.django_db
URL = "/api/v1/teams/acme/capacity/catalog"
PLAN = "/api/v1/teams/acme/capacity/plan"
QWEN3_8B = PRESETS["qwen3-8b"]


def checkpoint_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def add_checkpoint(run: Run, step: int, files: dict[str, bytes]) -> Checkpoint:
    uri = put_run_object(run, f"checkpoints/step-{step}.tar", checkpoint_tar(files))
    return Checkpoint.objects.create(run=run, team=run.team, step=step, uri=uri)


def test_catalog_lists_gpus_presets_and_dtypes(viewer):
    body = viewer.client.get(URL).json()
    assert [g["key"] for g in body["gpus"]] == ["H100-80GB", "H200-141GB", "A100-80GB",
                                                 "L40S-48GB", "B200-192GB"]
    h200 = body["gpus"][1]
    assert (h200["memory_bytes"], h200["bandwidth_bytes_s"]) == (141 * 10**9, 4800 * 10**9)
    assert "qwen3-30b-a3b" in body["presets"] and body["dtypes"] == ["bf16", "fp8", "int8",
                                                                      "int4"]


def test_plan_from_a_preset(viewer):
    # a viewer may plan: it computes and creates nothing
    response = viewer.client.post(PLAN, {"preset": "qwen3-30b-a3b", "gpu": "H100-80GB",
                                         "concurrency": 32, "context": 32768}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["source"] == "qwen3-30b-a3b"
    assert body["model"]["params_total"] == 30_532_122_624
    assert body["memory"]["kv_per_token"] == 98_304
    assert body["memory"]["kv_total"] == 32 * 32768 * 98_304
    assert body["memory"]["weights_by_dtype"]["fp8"] == 31_167_246_336
    assert body["gpus_needed"] == 4 and body["recommended"]["tp"] == 4
    assert {(lp["tp"], lp["ep"] > 1) for lp in body["layouts"]} >= {(1, False), (1, True),
                                                                     (8, False)}
    assert body["request"]["headroom"] == 0.1 and body["warnings"] == []


def test_plan_from_a_pasted_config(member):
    body = member.client.post(PLAN, {"config": QWEN3_8B, "gpu": "H200-141GB", "dtype": "fp8",
                                     "concurrency": 8, "context": 8192}, format="json").json()
    assert body["model"]["params_total"] == 8_190_735_360
    assert body["model"]["moe"] is None
    assert body["gpus_needed"] == 1


def test_plan_from_a_checkpoint(owner, project):
    run = make_run(project)
    tiny = json.dumps(PRESETS["crucible-tiny-moe"]).encode()
    ckpt = add_checkpoint(run, 5, {"global_step5/mp_rank_00.pt": b"\0" * 4096,
                                   "hf/config.json": tiny, "hf/model.safetensors": b"w"})
    for ref in (f"checkpoint:{ckpt.pk}", f"run:{run.pk}", f"run:{run.pk}@5"):
        response = owner.client.post(PLAN, {"checkpoint": ref, "concurrency": 4,
                                            "context": 128}, format="json")
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["source"].endswith("@ step 5")
        assert body["model"]["params_total"] == 457_408
        assert body["model"]["moe"]["num_experts"] == 8


def test_checkpoint_without_a_config_is_a_clear_400(owner, project):
    run = make_run(project)
    ckpt = add_checkpoint(run, 1, {"hf/model.safetensors": b"w"})
    response = owner.client.post(PLAN, {"checkpoint": f"checkpoint:{ckpt.pk}",
                                        "concurrency": 1, "context": 16}, format="json")
    assert response.status_code == 400
    assert "has no Hugging Face config.json" in response.json()["message"]
    # a checkpoint of another team is not found (the same words as a missing one)
    response = owner.client.post(PLAN, {"checkpoint": "checkpoint:999999", "concurrency": 1,
                                        "context": 16}, format="json")
    assert response.status_code == 400
    assert "'checkpoint:999999' matches no checkpoint in team 'acme'" in \
        response.json()["message"]


def test_not_a_tar_is_a_clear_400(owner, project):
    run = make_run(project)
    uri = put_run_object(run, "checkpoints/bad.tar", b"this is not a tar archive")
    ckpt = Checkpoint.objects.create(run=run, team=run.team, step=2, uri=uri)
    response = owner.client.post(PLAN, {"checkpoint": f"checkpoint:{ckpt.pk}",
                                        "concurrency": 1, "context": 16}, format="json")
    assert response.status_code == 400
    assert "cannot be read from the object store as a checkpoint archive" in \
        response.json()["message"]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"config": {k: v for k, v in QWEN3_8B.items() if k != "hidden_size"}}, "config",
     "config.hidden_size is missing"),
    ({"config": {**QWEN3_8B, "num_hidden_layers": -3}}, "config",
     "config.num_hidden_layers = -3 is out of range"),
    ({"preset": "qwen3-8b", "concurrency": 0}, "concurrency",
     "Ensure this value is greater than or equal to 1."),
    ({"preset": "qwen3-8b", "context": -1}, "context", "greater than or equal to 1"),
    ({"preset": "qwen3-8b", "headroom": 0.95}, "headroom", "less than or equal to 0.9"),
    ({"preset": "qwen3-8b", "gpu": "TPU-v5"}, "gpu", "is not a valid choice"),
    ({"preset": "gpt-5"}, "preset", "is not a valid choice"),
    ({"preset": "qwen3-8b", "config": QWEN3_8B}, "model",
     "give exactly one of preset, config or checkpoint (got preset, config)"),
    ({}, "model", "got none"),
    ({"preset": "qwen3-8b", "evil": 1}, "evil", "unknown field"),
    ({"config": {f"k{i}": "x" * 200 for i in range(400)}}, "config", "at most 65536"),
    ({"config": [1, 2]}, "config", "Expected a dictionary"),
])
def test_bad_requests_are_400_naming_the_field(member, body, field, words):
    doc = {"concurrency": 4, "context": 1024, **body}
    response = member.client.post(PLAN, doc, format="json")
    assert response.status_code == 400, response.content
    data = response.json()
    assert data["code"] == "invalid"
    assert field in data["errors"]
    assert words in json.dumps(data)


def test_outsider_gets_404(outsider, team):
    assert outsider.client.post(PLAN, {"preset": "qwen3-8b", "concurrency": 1,
                                       "context": 1}, format="json").status_code == 404
    assert outsider.client.get(URL).status_code == 404


def test_options_describes_the_request(viewer):
    # found by `make api-fuzz`: OPTIONS had no serializer to describe and answered 500
    response = viewer.client.options(PLAN)
    assert response.status_code == 200
    assert "concurrency" in response.json()["actions"]["POST"]
