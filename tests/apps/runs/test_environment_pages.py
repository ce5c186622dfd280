"""Environment pages (Django test client): list, environment and version pages for members
and viewers, 404 for outsiders, the QC report with quarantined tasks and their reasons,
eval reports rendered from the report JSON, and launching QC / eval runs from the page."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from apps.core.actor import Actor
from apps.environments import services
from apps.environments.views import eval_view, qc_view, spec_summary
from apps.runs import services as run_services
from apps.runs.models import Run, RunStatus
from apps.runs.validation import plan_run
from tests.factories import put_run_object

ARITH = {"env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}}
PAGE = "/t/acme/environments/arith/v1/"

QC_REPORT = {
    "schema": "crucible.qc/1", "passed": False, "blocked": True,
    "block_reasons": ["quarantined 2 of 4 tasks (50%) > 10%"],
    "environment_checks": [{"check": "load", "ok": True, "detail": "4 tasks", "seconds": 0.01},
                           {"check": "dependencies", "ok": True, "detail": "math-verify"}],
    "summary": {"tasks": 4, "quarantined": 2, "quarantine_rate": 0.5, "threshold": 0.1,
                "usable_tasks": {"train": 1, "eval": 1}, "reference_full_reward": 3,
                "empty_zero": 4, "by_reason": {"reference_fails": 1, "lax_checker": 1},
                "flags": {"exact_duplicate": 1}},
    "quarantined": [
        {"task_id": "t-17", "reasons": [{"check": "reference_fails",
                                         "detail": "reference earns 0.0 < 1.0"}]},
        {"task_id": "t-23", "reasons": [{"check": "lax_checker",
                                         "detail": "near-miss '<b>5</b>' earns 1.0"}]}],
    "quarantined_ids": ["t-17", "t-23"],
    "flags": [{"kind": "exact_duplicate", "task_ids": ["t-1", "t-2"],
               "detail": "same prompt and answer"}],
    "tasks": [{"task_id": f"t-{i}"} for i in range(4)],
}

EVAL_REPORT = {
    "schema": "crucible.eval/1", "policy": {"name": "tiny-moe-base"}, "split": "eval",
    "samples_per_task": 4, "k": [1, 4],
    "summary": {"tasks": 8, "samples": 32, "errors": 0, "mean_reward": 0.4375,
                "pass_at": {"1": 0.4375, "4": 0.8125},
                "latency_s": {"mean": 0.12, "p50": 0.1, "p95": 0.3},
                "completion_tokens_per_task": 17.5},
    "components": {"correct": {"weight": 1.0, "mean": 0.4375}},
    "by_difficulty": {"easy": {"tasks": 5, "mean_reward": 0.6, "pass_at": {"1": 0.6, "4": 1.0}},
                      "hard": {"tasks": 3, "mean_reward": 0.1667,
                               "pass_at": {"1": 0.1667, "4": 0.5}}},
    "by_topic": {"fractions": {"tasks": 8, "mean_reward": 0.4375,
                               "pass_at": {"1": 0.4375, "4": 0.8125}}},
}


def _session(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


@pytest.fixture
def version(project, member):
    actor = Actor.of_user(member.user)
    env = services.environment_create(actor=actor, team=project.team, project=project,
                                      slug="arith", description="sums and fractions")
    v, _ = services.version_register(actor=actor, environment=env, spec=ARITH)
    return v


def _eval_run(project, version, report: dict) -> Run:
    plan = plan_run(team=project.team, project=project.slug, kind="eval", config={},
                    name="base-eval", base_model="preset",
                    environment=f"arith@v{version.number}")
    run = run_services.create_run(actor=Actor.system(), team_id=project.team_id, plan=plan)
    uri = put_run_object(run, "eval-report.json", json.dumps(report).encode())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, report_uri=uri)
    return run


def test_pages_render_for_members_and_viewers(member, viewer, version):
    for caller in (member, viewer):
        client = _session(caller)
        listing = client.get("/t/acme/environments/").content.decode()
        assert 'href="/t/acme/environments/arith/"' in listing and "v1" in listing
        env_page = client.get("/t/acme/environments/arith/")
        assert env_page.status_code == 200
        html = env_page.content.decode()
        assert "built-in arithmetic" in html and version.digest[:12] in html
        assert 'href="/t/acme/environments/arith/v1/"' in html
        page = client.get(PAGE)
        assert page.status_code == 200
        assert version.digest in page.content.decode()
        assert client.get(f"/t/acme/environments/arith/{version.digest[:10]}/").status_code == 200
    member_html = _session(member).get(PAGE).content.decode()
    viewer_html = _session(viewer).get(PAGE).content.decode()
    assert 'id="launch-qc"' in member_html and 'id="no-qc"' in member_html
    assert 'id="launch-qc"' not in viewer_html and 'id="viewer-note"' in viewer_html


def test_outsiders_and_unknown_versions_get_404(outsider, member, version):
    client = _session(outsider)
    for url in ("/t/acme/environments/", "/t/acme/environments/arith/", PAGE):
        assert client.get(url).status_code == 404, url
    assert client.post(PAGE, {"op": "qc"}).status_code == 404
    assert _session(member).get("/t/acme/environments/arith/v9/").status_code == 404
    assert _session(member).get("/t/acme/environments/nope/").status_code == 404
    assert not Run.objects.exists()


def test_empty_states_tell_how_to_register(member, project):
    html = _session(member).get("/t/acme/environments/").content.decode()
    assert 'id="no-environments"' in html
    assert "POST /api/v1/teams/acme/environments" in html
    services.environment_create(actor=Actor.of_user(member.user), team=project.team,
                                project=project, slug="empty")
    html = _session(member).get("/t/acme/environments/empty/").content.decode()
    assert "POST /api/v1/teams/acme/environments/empty/versions" in html


def test_qc_report_shows_quarantined_tasks_reasons_flags_and_block(member, viewer, version):
    services.record_qc_report(actor=Actor.system(), version=version, report=QC_REPORT,
                              run_id="", report_uri="file:///x/qc.json")
    html = _session(viewer).get(PAGE).content.decode()
    assert "Blocked for training:" in html and "quarantined 2 of 4 tasks (50%) &gt; 10%" in html
    assert 'data-task="t-17"' in html and "reference earns 0.0 &lt; 1.0" in html
    # Task-supplied text is escaped, never markup.
    assert "near-miss &#x27;&lt;b&gt;5&lt;/b&gt;&#x27; earns 1.0" in html
    assert "<b>5</b>" not in html
    assert 'data-flag="exact_duplicate"' in html and "t-1</code>, <code>t-2" in html
    assert 'data-check="dependencies"' in html and "50%" in html
    listing = _session(viewer).get("/t/acme/environments/arith/").content.decode()
    assert "badge qc-failed" in listing and "quarantined 2 of 4 tasks" in listing


def test_eval_report_renders_pass_at_k_and_breakdowns(viewer, project, version):
    run = _eval_run(project, version, EVAL_REPORT)
    html = _session(viewer).get(PAGE).content.decode()
    assert f'data-run="{run.pk}"' in html and "tiny-moe-base" in html
    assert "pass@4" in html and "0.813" in html and "0.438" in html
    assert "By difficulty" in html and ">hard<" in html and "fractions" in html


def test_launch_qc_from_the_page_creates_a_qc_run(member, version):
    client = _session(member)
    r = client.post(PAGE, {"op": "qc", "name": "qc from page", "repeats": "1"})
    assert r.status_code == 302 and r["Location"] == PAGE
    run = Run.objects.get()
    assert run.kind == "qc" and run.name == "qc from page"
    assert run.config["qc"]["repeats"] == 1 and run.created_by == member.user
    assert list(run.environment_pins.values_list("environment_version", flat=True)) == [
        version.pk]
    html = client.get(PAGE).content.decode()
    assert f"QC run {str(run.pk)[:8]} queued" in html and f'data-run="{run.pk}"' in html


def test_launch_eval_from_the_page_and_its_errors_next_to_the_fields(member, version):
    client = _session(member)
    bad = client.post(PAGE, {"op": "eval", "base_model": "preset", "k": "4"})
    assert bad.status_code == 400
    html = bad.content.decode()
    assert 'role="alert"' in html and "samples_per_task" in html
    assert not Run.objects.exists()
    ok = client.post(PAGE, {"op": "eval", "base_model": "preset", "samples_per_task": "4",
                            "k": "1, 4"})
    assert ok.status_code == 302, ok.content.decode()[:2000]
    run = Run.objects.get()
    assert run.kind == "eval" and run.config["k"] == [1, 4]
    assert run.config["model"]["source"] == "preset"


def test_viewers_cannot_launch(viewer, version):
    r = _session(viewer).post(PAGE, {"op": "qc"})
    assert r.status_code == 403 and "member role" in r.content.decode()
    assert not Run.objects.exists()


def test_presenters_survive_odd_documents():
    assert spec_summary({"image": "acme/secret:1"})["source"] == "unknown"
    assert spec_summary(None)["label"] == "unknown"
    tasks = spec_summary({"env": {"source": "tasks", "tasks": [{"id": "a"}],
                                  "rubric": {"components": [{"name": "c", "checker": "x"}]}}})
    assert tasks["label"] == "1 uploaded task" and tasks["components"][0]["checker"] == "x"
    assert qc_view({}) is None
    assert qc_view({"passed": True, "flags": ["junk"]})["flags"] == []
    view = eval_view({"k": [1, 2], "summary": {"pass_at": {"1": 0.5}}})
    assert view["ks"] == ["1", "2"] and view["pass_at"] == [0.5, None]
