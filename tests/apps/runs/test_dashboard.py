"""Dashboard pages through Django's test client: the runs table (filters, sort, paging and a
query count that does not grow with the page), the launch form (API validation, errors by
field, preview, presets, clone), the run page's panels, compare, and the team page."""

from __future__ import annotations

import json
import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.lineage import services as lineage
from apps.runs import dashboard
from apps.runs.models import Checkpoint, Run, RunStatus, Sample
from apps.teams.models import ApiToken, Membership, Role, TokenKind
from tests.factories import DatasetFactory, make_run, make_train_run, make_version, put_run_object

PAGE = "/t/acme/"
TEAM = "/t/acme/team/"


def browser_for(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


@pytest.fixture
def qa(project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset, [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)])
    dataset.refresh_from_db()
    return dataset


def bulk_runs(project, n: int, *, user=None, env_version=None, kind="profile",
              status=RunStatus.QUEUED, prefix="run") -> list[Run]:
    return Run.objects.bulk_create(
        Run(team=project.team, project=project, name=f"{prefix}-{i:05d}", kind=kind,
            status=status, config={"i": i}, pool="cpu", created_by=user,
            environment_version=env_version)
        for i in range(n)
    )


# --- runs table ------------------------------------------------------------------------------


def _table_queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    return len(ctx.captured_queries)


def test_runs_table_query_count_is_constant_per_page(member, project):
    client = browser_for(member)
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="arith")
    version, _ = env_services.version_create(actor=Actor.system(), environment=env,
                                             spec={"task": "a"})
    bulk_runs(project, 10, user=member.user, env_version=version)
    few_page, few_rows = (_table_queries(client, PAGE),
                          _table_queries(client, PAGE + "?sort=name"))
    bulk_runs(project, 290, user=member.user, env_version=version, prefix="more")
    many_page, many_rows = (_table_queries(client, PAGE),
                            _table_queries(client, PAGE + "?sort=name&page=3"))
    assert many_page == few_page
    assert many_rows == few_rows
    # The htmx partial (filters, paging, live reloads) is as flat.
    with CaptureQueriesContext(connection) as ctx:
        client.get(PAGE + "?kind=profile", HTTP_HX_REQUEST="true", HTTP_HX_TARGET="runs")
    assert len(ctx.captured_queries) <= few_page


def _points(run: Run, name: str, values: list[float]) -> None:
    from apps.metrics.models import MetricPoint, MetricSeries

    MetricPoint.objects.bulk_create(MetricPoint(run=run, name=name, step=i, value=v,
                                                wall_time=1.7e9 + i)
                                    for i, v in enumerate(values))
    MetricSeries.objects.create(run=run, name=name, count=len(values), first_step=0,
                                last_step=len(values) - 1)


def test_runs_table_metric_columns_group_and_csv(member, project):
    client = browser_for(member)
    a, b = bulk_runs(project, 2, user=member.user, kind="train")
    c = bulk_runs(project, 1, user=member.user, kind="eval", prefix="ev")[0]
    Run.objects.filter(pk=a.pk).update(tags=["sweep", "lr-high"])
    _points(a, "reward_mean", [0.1, 0.9, 0.4])
    _points(a, "loss", [3.0, 0.5, 1.0])
    _points(b, "reward_mean", [0.2, 0.3])
    query = ("?m=reward_mean:last&m=reward_mean:best&m=loss:best&col=kind&col=duration"
             "&group=kind")
    html = client.get(PAGE + query).content.decode()
    assert "reward_mean (last)" in html and "reward_mean (best, max)" in html
    assert "loss (best, min)" in html  # a loss is best at its minimum
    row = re.search(rf'value="{a.pk}".*?</tr>', html, re.S).group(0)
    cells = re.findall(r'data-col="([^"]+)">([^<]+)<', row)
    assert cells == [("reward_mean:last", "0.4"), ("reward_mean:best", "0.9"),
                     ("loss:best", "0.5")]
    assert 'data-col="creator"' not in html  # only the chosen columns
    groups = re.findall(r'<tbody data-group="([^"]+)"', html)
    assert groups == ["eval", "train"]
    csv = client.get(PAGE + query + "&format=csv")
    assert csv["Content-Type"].startswith("text/csv")
    lines = csv.content.decode().splitlines()
    assert lines[0] == ('id,Run,Kind,Status,Duration,reward_mean (last),'
                        '"reward_mean (best, max)","loss (best, min)",tags')
    body = {line.split(",")[0]: line for line in lines[1:]}
    assert set(body) == {str(a.pk), str(b.pk), str(c.pk)}
    assert body[str(a.pk)].endswith("sweep lr-high") and ",0.4," in body[str(a.pk)]
    # Metric columns cost the same queries whatever the page holds.
    few = _table_queries(client, PAGE + query)
    bulk_runs(project, 40, user=member.user, kind="train", prefix="more")
    assert _table_queries(client, PAGE + query) == few


def test_runs_table_filters_sort_and_pages(member, project, make_caller, team):
    other = make_caller(team, Role.MEMBER, "bob")
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="arith")
    version, _ = env_services.version_create(actor=Actor.system(), environment=env,
                                             spec={"task": "a"})
    bulk_runs(project, 3, user=member.user, prefix="mine")
    bulk_runs(project, 2, user=other.user, env_version=version, kind="train",
              status=RunStatus.RUNNING, prefix="bobs")
    client = browser_for(member)

    def names(query: str) -> list[str]:
        html = client.get(PAGE + query).content.decode()
        return re.findall(r'>((?:mine|bobs|run|more)-\d+)</a>', html)

    assert len(names("")) == 5
    assert names("?kind=train") == ["bobs-00001", "bobs-00000"] or \
        sorted(names("?kind=train")) == ["bobs-00000", "bobs-00001"]
    assert sorted(names("?status=running")) == ["bobs-00000", "bobs-00001"]
    assert sorted(names("?creator=mia")) == ["mine-00000", "mine-00001", "mine-00002"]
    assert sorted(names("?environment=arith")) == ["bobs-00000", "bobs-00001"]
    assert names("?sort=name") == ["bobs-00000", "bobs-00001", "mine-00000", "mine-00001",
                                   "mine-00002"]
    assert names("?sort=-name")[0] == "mine-00002"
    assert names("?q=bobs-00001") == ["bobs-00001"]
    empty = client.get(PAGE + "?kind=train&creator=mia").content.decode()
    assert "No runs match these filters" in empty
    # Unknown filter values are ignored, not a 500.
    assert client.get(PAGE + "?kind=nope&sort=evil&page=x").status_code == 200

    bulk_runs(project, dashboard.PAGE_SIZE, user=member.user, prefix="run")
    first = names("?sort=name")
    second = names("?sort=name&page=2")
    assert len(first) == dashboard.PAGE_SIZE and len(second) == 5
    assert not set(first) & set(second)
    assert 'rel="next"' in client.get(PAGE + "?sort=name").content.decode()


def test_runs_table_is_team_scoped(member, outsider, project):
    bulk_runs(project, 2)
    assert browser_for(outsider).get(PAGE).status_code == 404
    assert browser_for(member).get("/t/rival/").status_code == 404


def test_empty_runs_table_says_what_to_do(member, project):
    html = browser_for(member).get(PAGE).content.decode()
    assert "No runs here yet" in html and "/t/acme/launch/" in html


# --- launch form -----------------------------------------------------------------------------


def form(**overrides) -> dict:
    return {"project": "main", "kind": "profile", "name": "p1", "datasets": ["qa"],
            "environment": "", "pool": "", "priority": "0", "config": "{}",
            "action": "launch", **overrides}


def test_launch_form_creates_the_run_like_the_api(member, qa):
    client = browser_for(member)
    page = client.get("/t/acme/launch/?preset=profile")
    assert page.status_code == 200
    assert "progress_every" in page.content.decode()
    response = client.post("/t/acme/launch/", form())
    assert response.status_code == 302
    run = Run.objects.get()
    assert response["Location"] == f"/t/acme/runs/{run.pk}/"
    assert run.created_by == member.user
    assert run.config == {"dataset": "qa", "max_records": None, "progress_every": 1000,
                          "top_values": 5}
    assert [p.alias for p in run.pins.all()] == ["qa"]


def test_launch_form_preview_creates_nothing(member, qa):
    response = browser_for(member).post("/t/acme/launch/", form(action="preview"))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="preview"' in html and "&quot;record_count&quot;: 4" in html
    assert not Run.objects.exists()


def test_launch_form_shows_errors_next_to_fields(member, qa):
    client = browser_for(member)
    bad_json = client.post("/t/acme/launch/", form(config="{nope"))
    assert bad_json.status_code == 400
    assert re.search(r'id="err_config"[^>]*>\s*<li>Not valid JSON', bad_json.content.decode())

    unknown = client.post("/t/acme/launch/", form(config='{"top_valuez": 3}'))
    html = unknown.content.decode()
    assert unknown.status_code == 400
    assert re.search(r'id="err_config".*top_valuez.*unknown field', html, re.S)
    assert 'aria-invalid="true"' in html

    no_dataset = client.post("/t/acme/launch/", form(datasets=[]))
    assert re.search(r'id="err_datasets".*pins exactly 1 dataset', no_dataset.content.decode(),
                     re.S)
    train_bad = client.post("/t/acme/launch/", form(
        kind="train", datasets=[], config=json.dumps({"trainer": {"steps": 0}})))
    assert re.search(r'id="err_config".*trainer\.steps', train_bad.content.decode(), re.S)
    assert not Run.objects.exists()


def test_launch_presets_validate(member, qa):
    from apps.runs.forms import PRESETS
    from apps.runs.validation import plan_run

    for key, preset in PRESETS.items():
        plan_run(team=qa.team, project="main", kind=preset["kind"], config=preset["config"],
                 datasets=["qa"] if preset["kind"] == "profile" else [])
        assert browser_for(member).get(f"/t/acme/launch/?preset={key}").status_code == 200, key


def test_clone_prefills_from_run(member, qa, project):
    run = make_run(project, qa, name="orig", config={"top_values": 7})
    html = browser_for(member).get(f"/t/acme/launch/?clone={run.pk}").content.decode()
    assert "orig-clone" in html
    assert "&quot;top_values&quot;: 7" in html
    assert '<option value="qa" selected>' in html


def test_viewers_cannot_launch(viewer, qa):
    client = browser_for(viewer)
    page = client.get("/t/acme/launch/").content.decode()
    assert "you can read this form but not launch runs" in page
    assert 'value="launch"' not in page
    assert client.post("/t/acme/launch/", form()).status_code == 403
    assert not Run.objects.exists()


# --- run page --------------------------------------------------------------------------------


def test_run_page_shows_checkpoints_samples_and_lineage(member, qa, project):
    run = make_train_run(project, name="trained", datasets=[])
    lineage.edge_create(team_id=run.team_id, source=qa.current_version, target=run,
                        relation="input")
    Checkpoint.objects.create(run=run, team=run.team, step=10, uri="file:///x/10",
                              metrics={"reward_mean": 0.5})
    Sample.objects.bulk_create([
        Sample(run=run, team=run.team, step=10, prompt="2+2=", completion="4", reward=1.0,
               reward_components={"correct": 1.0, "format": 1.0}),
        Sample(run=run, team=run.team, step=10, prompt="3+3=", completion="7", reward=0.1,
               reward_components={"correct": 0.0, "format": 0.5}),
        Sample(run=run, team=run.team, step=5, prompt="1+1=", completion="2", reward=1.0),
    ])
    client = browser_for(member)
    html = client.get(f"/t/acme/runs/{run.pk}/").content.decode()
    assert "file:///x/10" in html and "reward_mean" in html
    assert "dataset qa v1" in html  # lineage neighbour, labelled
    assert html.index("2+2=") < html.index("3+3=")  # highest reward first
    assert f'hx-get="/t/acme/runs/{run.pk}/samples/"' in html  # the page's partial, not the API
    low_first = client.get(f"/t/acme/runs/{run.pk}/samples/?step=10&sort=reward").content
    assert low_first.index(b"3+3=") < low_first.index(b"2+2=")
    assert b"<th scope=\"col\">correct</th>" in low_first
    other_step = client.get(f"/t/acme/runs/{run.pk}/samples/?step=5").content
    assert b"1+1=" in other_step and b"2+2=" not in other_step


def test_run_page_cancel_and_resume(member, viewer, qa, project):
    run = make_run(project, qa)
    page = f"/t/acme/runs/{run.pk}/"
    assert browser_for(viewer).post(page, {"op": "cancel"}).status_code == 403
    client = browser_for(member)
    assert client.post(page, {"op": "cancel"}).status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED
    client.post(page, {"op": "resume"})
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED


# --- compare ---------------------------------------------------------------------------------


def test_flatten_and_config_diff():
    assert dashboard.flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {
        "a.b": 1, "a.c": [1, 2], "d": {}}
    rows = dashboard.config_table([{"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3, "e": 0}}])
    assert [(r.key, r.differs) for r in rows] == [("a.b", False), ("a.c", True), ("a.e", True)]
    assert rows[2].values[0] is dashboard.MISSING
    # 1 and 1.0 and True are different settings in a config.
    assert dashboard.config_table([{"x": 1}, {"x": True}])[0].differs


def test_report_table_marks_regressions():
    rows = {r.key: r for r in dashboard.report_table([
        {"accuracy": 0.80, "loss": 1.0, "name": "a"},
        None,
        {"accuracy": 0.70, "loss": 0.5, "name": "b"},
        {"accuracy": 0.805, "loss": 1.2},
    ])}
    assert set(rows) == {"accuracy", "loss"}  # numeric leaves only
    acc, loss = rows["accuracy"].cells, rows["loss"].cells
    assert acc[1].value is dashboard.MISSING
    assert acc[2].regression and not acc[2].improvement
    assert not acc[3].regression and not acc[3].improvement  # within 1%
    assert loss[2].improvement  # lower loss is better
    assert loss[3].regression


def test_compare_page_diffs_configs(member, qa, project):
    a = make_run(project, qa, name="a", config={"top_values": 5})
    b = make_run(project, qa, name="b", config={"top_values": 9})
    html = browser_for(member).get(f"/t/acme/compare/?run={a.pk}&run={b.pk}").content.decode()
    differing = re.findall(r'<tr class="differs" data-key="([^"]+)"', html)
    same = re.findall(r'<tr class="same" data-key="([^"]+)"', html)
    assert differing == ["top_values"]
    assert "progress_every" in same and "dataset" in same
    assert "only-diff" in html
    assert "None of these runs has a report" in html


def test_compare_page_puts_reports_side_by_side(member, qa, project, object_store):
    runs = [make_run(project, qa, name=n) for n in ("base", "worse", "better")]
    for run, accuracy in zip(runs, (0.8, 0.6, 0.9), strict=True):
        uri = put_run_object(run, "report.json",
                             json.dumps({"eval": {"accuracy": accuracy}}).encode())
        Run.objects.filter(pk=run.pk).update(report_uri=uri)
    query = "&".join(f"run={r.pk}" for r in runs)
    html = browser_for(member).get(f"/t/acme/compare/?{query}").content.decode()
    row = re.search(r"<code>eval\.accuracy</code>.*?</th>(.*?)</tr>", html, re.S).group(1)
    cells = re.findall(r'<td class="num( regression| improvement)?">([^<]+)', row)
    assert cells == [("", "0.8"), (" regression", "0.6"), (" improvement", "0.9")]
    # Another baseline, chosen on the page: the marks follow it.
    html = browser_for(member).get(
        f"/t/acme/compare/?{query}&baseline={runs[2].pk}").content.decode()
    row = re.search(r"<code>eval\.accuracy</code>.*?</th>(.*?)</tr>", html, re.S).group(1)
    cells = re.findall(r'<td class="num( regression| improvement)?">([^<]+)', row)
    assert cells == [(" regression", "0.8"), (" regression", "0.6"), ("", "0.9")]


@pytest.mark.parametrize(("key", "lower"), [
    ("summary.latency_s.mean", True), ("summary.latency_s.p95", True), ("loss", True),
    ("summary.tokens_per_task.mean", True), ("eval.errors", True), ("wall_time_s", True),
    ("summary.pass_at.1", False), ("summary.mean_reward", False), ("accuracy", False),
    ("gen_tokens_per_s", False), ("throughput.items_per_s", False), ("components.format", False),
])
def test_each_report_metric_knows_its_direction(key, lower):
    assert dashboard.lower_is_better(key) is lower


def test_latency_going_up_is_a_regression():
    """0.035 s -> 1.079 s mean latency was shown green (``mean`` read as higher-is-better)."""
    rows = {r.key: r for r in dashboard.report_table([
        {"summary": {"latency_s": {"mean": 0.035}, "pass_at": {"1": 0.30}}},
        {"summary": {"latency_s": {"mean": 1.079}, "pass_at": {"1": 0.35}}},
    ])}
    assert rows["summary.latency_s.mean"].cells[1].regression
    assert rows["summary.pass_at.1"].cells[1].improvement


def test_compare_caps_and_scopes(member, outsider, project):
    runs = bulk_runs(project, 12)
    query = "&".join(f"run={r.pk}" for r in runs)
    html = browser_for(member).get(f"/t/acme/compare/?{query}&run=junk").content.decode()
    assert "Only the first 10 runs are compared" in html
    assert html.count('class="swatch"') == 10
    assert browser_for(outsider).get(f"/t/acme/compare/?{query}").status_code == 404


# --- team page -------------------------------------------------------------------------------


def test_personal_token_shown_once_and_revoked(member):
    client = browser_for(member)
    created = client.post(TEAM, {"op": "token-create", "kind": "personal", "name": "laptop"})
    assert created.status_code == 201
    secret = re.search(r'id="new-token-secret" type="text" readonly value="([^"]+)"',
                       created.content.decode()).group(1)
    token = ApiToken.objects.get(user=member.user, name="laptop")
    assert token.prefix in secret
    again = client.get("/t/acme/team/").content.decode()
    assert secret not in again and token.prefix in again
    # The secret works against the API until revoked.
    api = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api.get("/api/v1/teams/acme/runs").status_code == 200
    assert client.post(TEAM, {"op": "token-revoke", "prefix": token.prefix}).status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert api.get("/api/v1/teams/acme/runs").status_code == 401
    assert client.post(TEAM, {"op": "token-create", "kind": "personal",
                              "name": " "}).status_code == 400
    assert client.post(TEAM, {"op": "drop-tables"}).status_code == 400


def test_worker_tokens_are_for_admins(member, admin):
    assert "Worker tokens" not in browser_for(member).get("/t/acme/team/").content.decode()
    worker = {"op": "token-create", "kind": "worker", "name": "pool"}
    assert browser_for(member).post(TEAM, worker).status_code == 404
    client = browser_for(admin)
    assert client.post(TEAM, worker).status_code == 201
    token = ApiToken.objects.get(kind=TokenKind.WORKER, name="pool")
    assert token.team.slug == "acme"
    # A member cannot revoke the team's worker token; an admin can.
    revoke = {"op": "token-revoke", "prefix": token.prefix}
    assert browser_for(member).post(TEAM, revoke).status_code == 404
    client.post(TEAM, revoke)
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_members_and_roles(owner, admin, member, make_caller):
    newbie = make_caller(None, username="newbie")
    client = browser_for(admin)
    invited = client.post(TEAM, {"op": "invite-create", "role": "viewer"})
    assert invited.status_code == 201 and "no-store" in invited["Cache-Control"]
    code = re.search(r'value="(cri_[^"]+)"', invited.content.decode()).group(1)
    joined = browser_for(newbie).post("/invite/", {"code": code})
    assert joined.status_code == 302 and joined["Location"] == "/t/acme/"
    assert Membership.objects.get(user__username="newbie").role == Role.VIEWER
    # The code is used up; a second person gets the same answer as for a made-up code.
    other = make_caller(None, username="other")
    used = browser_for(other).post("/invite/", {"code": code})
    made_up = browser_for(other).post("/invite/", {"code": "cri_0000_nope"})
    assert used.status_code == made_up.status_code == 404
    assert b"not valid" in used.content and b"not valid" in made_up.content
    change = {"op": "member-change", "username": "newbie"}
    client.post(TEAM, {**change, "role": "member"})
    assert Membership.objects.get(user__username="newbie").role == Role.MEMBER
    # Only owners grant ownership; the service's message is shown, nothing changes.
    response = client.post(TEAM, {**change, "role": "owner"}, follow=True)
    assert b"Only an owner" in response.content
    assert Membership.objects.get(user__username="newbie").role == Role.MEMBER
    assert browser_for(member).post(TEAM, {**change, "remove": "1"}).status_code == 404
    client.post(TEAM, {**change, "remove": "1"})
    assert not Membership.objects.filter(user__username="newbie").exists()
    html = browser_for(member).get("/t/acme/team/").content.decode()
    assert "olivia" in html and "Invite someone" not in html
