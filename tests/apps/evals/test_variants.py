"""``/api/v1/teams/<team>/variants``: served variants of a checkpoint (int8, n-gram and draft
speculative decoding) recorded with lineage edges, evaluated by a suite at creation with the
variant's serving settings in every eval run's config; bad documents are 400 naming the
field; another team's checkpoints cannot be a source or a draft; outsiders get 404."""

from __future__ import annotations

import pytest

from apps.core.models import AuditLog
from apps.evals.models import ServedVariant, SubjectKind, SuiteEvaluation
from apps.lineage.models import LineageEdge
from apps.runs.models import Checkpoint, Run
from tests.factories import make_run, put_run_object

pytestmark = pytest.mark.django_db
VARIANTS = "/api/v1/teams/acme/variants"
SUITES = "/api/v1/teams/acme/evals/suites"


def _checkpoint(project, step: int) -> Checkpoint:
    run = make_run(project)
    return Checkpoint.objects.create(run=run, team=project.team, step=step, uri=put_run_object(
        run, f"checkpoints/step-{step}.tar", b"weights"))


@pytest.fixture
def ckpt(project):
    return _checkpoint(project, 5)


@pytest.fixture
def suite(member, arith):
    r = member.client.post(SUITES, {"slug": "core", "project": "main", "entries": [
        {"environment": "arith@v1", "sampling": {"max_tokens": 6}},
        {"environment": "arith@v1", "metric": "mean_reward"}]}, format="json")
    assert r.status_code == 201, r.content
    return "core"


def _edges(source: tuple[str, str] | None = None, target: tuple[str, str] | None = None):
    rows = LineageEdge.objects.all()
    if source:
        rows = rows.filter(source_type=source[0], source_id=source[1])
    if target:
        rows = rows.filter(target_type=target[0], target_id=target[1])
    return {(e.source_type, e.source_id, e.relation, e.target_type, e.target_id) for e in rows}


def test_int8_variant_evaluated_by_a_suite_with_its_settings(member, viewer, ckpt, suite):
    r = member.client.post(VARIANTS, {"checkpoint": f"checkpoint:{ckpt.pk}", "kind": "int8",
                                      "suite": suite}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["kind"] == "int8" and body["checkpoint"] == ckpt.pk and body["step"] == 5
    assert body["serving"]["int8"] is True and body["serving"]["ngram_draft"] == 0
    assert body["serve_flags"] == ["--int8"]
    assert body["label"].endswith("@ step 5 (int8)")
    variant = ServedVariant.objects.get(pk=body["id"])
    evaluation = SuiteEvaluation.objects.get(pk=body["evaluation"])
    assert evaluation.subject_kind == SubjectKind.VARIANT and evaluation.checkpoint == ckpt
    assert evaluation.trigger == "variant"
    runs = [res.run for res in evaluation.results.select_related("run")]
    assert len(runs) == 2
    for run in runs:  # each eval run serves the source checkpoint with int8 weights
        assert run.kind == "eval"
        assert run.config["model"]["path"] == ckpt.uri
        assert run.config["serving"]["int8"] is True
    key = ("served_variant", str(variant.pk))
    assert ("checkpoint", str(ckpt.pk), "variant", *key) in _edges(target=key)
    assert _edges(source=key) == {(*key, "evaluated", "run", str(run.pk)) for run in runs}
    assert AuditLog.objects.filter(action="evals.variant.create",
                                   target_id=str(variant.pk)).exists()
    # the variant's lineage graph reaches its checkpoint and its eval runs
    graph = viewer.client.get(f"/api/v1/teams/acme/lineage?artifact=served_variant:"
                              f"{variant.pk}")
    assert graph.status_code == 200, graph.content
    nodes = {(n["type"], n["id"]) for n in graph.json()["nodes"]}
    assert ("checkpoint", str(ckpt.pk)) in nodes and ("run", str(runs[0].pk)) in nodes

    listed = viewer.client.get(VARIANTS).json()["results"]
    assert [v["id"] for v in listed] == [variant.pk]
    assert viewer.client.get(f"{VARIANTS}/{variant.pk}").json()["kind"] == "int8"
    assert viewer.client.get(f"{VARIANTS}?checkpoint={ckpt.pk + 1000}").json()["results"] == []
    assert viewer.client.get(f"{VARIANTS}?checkpoint=x").status_code == 400


def test_draft_and_ngram_variants(member, project, ckpt, suite):
    draft = _checkpoint(project, 9)
    r = member.client.post(VARIANTS, {
        "checkpoint": f"checkpoint:{ckpt.pk}", "kind": "draft", "int8": True,
        "draft_checkpoint": f"run:{draft.run_id}@9", "num_speculative_tokens": 3,
        "suite": suite, "label": "fast"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["draft_checkpoint"] == draft.pk and body["label"] == "fast"
    assert body["serving"] == {"int8": True, "ngram_draft": 0, "num_speculative_tokens": 3}
    assert body["serve_flags"][:1] == ["--int8"] and "--draft-checkpoint" in body["serve_flags"]
    key = ("served_variant", str(body["id"]))
    assert ("checkpoint", str(draft.pk), "draft", *key) in _edges(target=key)
    evaluation = SuiteEvaluation.objects.get(pk=body["evaluation"])
    for res in evaluation.results.select_related("run"):
        # the draft is pinned to its object like the base model
        assert res.run.config["serving"] == {"int8": True, "ngram_draft": 0,
                                             "num_speculative_tokens": 3, "draft": draft.uri}

    r = member.client.post(VARIANTS, {"checkpoint": f"checkpoint:{ckpt.pk}", "kind": "ngram"},
                           format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["serving"] == {"int8": False, "ngram_draft": 3, "num_speculative_tokens": 4}
    assert body["evaluation"] is None and body["serve_flags"] == [
        "--ngram-draft", "3", "--num-speculative-tokens", "4"]


@pytest.mark.parametrize(("doc", "field", "words"), [
    ({"kind": "draft"}, "draft_checkpoint", "needs draft_checkpoint"),
    ({"kind": "int8", "ngram": 2}, "ngram", "for kind 'ngram' only"),
    ({"kind": "int8", "num_speculative_tokens": 2}, "num_speculative_tokens", "speculative"),
    ({"kind": "ngram", "draft_checkpoint": "checkpoint:{ckpt}"}, "draft_checkpoint",
     "draft' only"),
    ({"kind": "fp4"}, "kind", ""),
    ({"kind": "ngram", "ngram": 0}, "ngram", ""),
    ({"kind": "int8", "suite": "ghost"}, "suite", "no eval suite"),
    ({"kind": "int8", "checkpoint": "checkpoint:999999"}, "checkpoint", "matches no checkpoint"),
    ({"kind": "int8", "extra": 1}, "extra", ""),
])
def test_bad_documents_are_400_naming_the_field(member, ckpt, doc, field, words):
    body = {"checkpoint": f"checkpoint:{ckpt.pk}",
            **{k: v.format(ckpt=ckpt.pk) if isinstance(v, str) else v for k, v in doc.items()}}
    r = member.client.post(VARIANTS, body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"], r.json()
    assert words in r.json()["message"]
    assert not ServedVariant.objects.exists()


def test_another_teams_checkpoints_are_refused(member, outsider, other_team, ckpt):
    from tests.factories import ProjectFactory

    theirs = _checkpoint(ProjectFactory(team=other_team, slug="main"), 3)
    r = member.client.post(VARIANTS, {"checkpoint": f"checkpoint:{theirs.pk}", "kind": "int8"},
                           format="json")
    assert r.status_code == 400 and "matches no checkpoint" in r.json()["message"]
    r = member.client.post(VARIANTS, {"checkpoint": f"checkpoint:{ckpt.pk}", "kind": "draft",
                                      "draft_checkpoint": f"checkpoint:{theirs.pk}"},
                           format="json")
    assert r.status_code == 400 and "draft_checkpoint" in r.json()["errors"]
    assert not ServedVariant.objects.exists()


def test_roles_and_outsiders(member, viewer, outsider, ckpt):
    doc = {"checkpoint": f"checkpoint:{ckpt.pk}", "kind": "int8"}
    assert viewer.client.post(VARIANTS, doc, format="json").status_code == 403
    assert outsider.client.post(VARIANTS, doc, format="json").status_code == 404
    vid = member.client.post(VARIANTS, doc, format="json").json()["id"]
    assert outsider.client.get(VARIANTS).status_code == 404
    assert outsider.client.get(f"{VARIANTS}/{vid}").status_code == 404
    # through the outsider's own team URL the variant does not exist either
    assert outsider.client.get(f"/api/v1/teams/rival/variants/{vid}").status_code == 404
    assert member.client.get(f"{VARIANTS}/abc").status_code == 404


def test_eval_run_serving_draft_must_be_the_teams_checkpoint(member, ckpt, arith):
    """Launched directly, an eval run's serving.draft is a reference the launch resolves in
    the team: a raw URI or path is refused, a reference is pinned to the checkpoint's URI."""
    def launch(serving):
        return member.client.post("/api/v1/teams/acme/runs", {
            "project": "main", "kind": "eval", "environment": "arith@v1",
            "base_model": f"checkpoint:{ckpt.pk}", "config": {"serving": serving}},
            format="json")

    for raw in (ckpt.uri, "/etc", "path:/srv/models/x"):
        r = launch({"draft": raw})
        assert r.status_code == 400 and "config.serving.draft" in r.json()["errors"], r.content
    r = launch({"draft": "checkpoint:999999"})
    assert r.status_code == 400 and "config.serving.draft" in r.json()["message"]
    r = launch({"draft": f"checkpoint:{ckpt.pk}", "ngram_draft": 2})
    assert r.status_code == 400 and "not both" in r.json()["message"]
    r = launch({"draft": f"checkpoint:{ckpt.pk}", "int8": True})
    assert r.status_code == 201, r.content
    run = Run.objects.get(pk=r.json()["id"])
    assert run.config["serving"]["draft"] == ckpt.uri and run.config["serving"]["int8"]
    r = member.client.post("/api/v1/teams/acme/runs", {
        "project": "main", "kind": "eval", "environment": "arith@v1",
        "config": {"policy": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
                   "serving": {"int8": True}}}, format="json")
    assert r.status_code == 400 and "endpoint policy" in r.json()["message"]
