"""Cross-tenant isolation, over every team-scoped route the URLconf serves.

The route list comes from walking the URLconf (tests/apps/api/test_urlconf.py), so a new
endpoint joins this matrix as soon as it is routed; if it needs a URL kwarg this file
does not know, ``test_every_team_route_gets_a_concrete_url`` says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from django.apps import apps
from django.test import Client
from django.urls import resolve
from rest_framework.test import APIClient

from apps.core.actor import Actor
from apps.datasets.models import Dataset
from apps.environments import services as environment_services
from apps.runs.models import Checkpoint, Run
from apps.teams import services as team_services
from apps.teams.models import ApiToken, Membership, Role
from apps.teams.services import worker_token_create
from tests.apps.api.test_urlconf import Route, team_pages, team_routes, worker_routes
from tests.django_fixtures import client_for_token
from tests.factories import DatasetFactory, make_run, make_version, put_run_object
from tests.skips import sandbox_unavailable

TEAM_ROUTES = team_routes()
TEAM_PAGES = team_pages()
WORKER_ROUTES = worker_routes()

#: Query strings a GET needs to get past input validation (so the owner's control is a 200).
QUERY = {"lineage-list": "artifact=run:{run}", "run-compare": "run={run}",
         "sandbox-session-files": "path=f", "sandbox-session-listing": "path="}
#: Team-level GETs that look objects up by query string: through another team's URL they
#: are a 404 (the object is not that team's), like a detail URL, not an empty list.
LOOKUPS_BY_QUERY = {"run-compare"}

#: Bodies for endpoints that refuse unknown keys (everything else gets World.body()).
STRICT_BODIES = {
    "batch-list": {"dataset": "acme-secret-ds", "records": [{"prompt": "pwned", "answer": "0"}]},
    "review-item-verdict": {"verdict": "accept"},
    "execution-list": {"language": "python", "code": "print('pwned')"},
    "execution-batch": {"requests": [{"language": "python", "code": "print('pwned')"}]},
    "environment-version-list": {"spec": {"source": "builtin", "name": "arithmetic"}},
    "environment-version-evaluate": {"base_model": "preset"},
    # Launches refuse unknown fields, so they get exactly a launch document.
    "run-list": {"project": "main", "kind": "profile", "config": {},
                 "datasets": ["acme-secret-ds"]},
    "run-preview": {"project": "main", "kind": "profile", "config": {},
                    "datasets": ["acme-secret-ds"]},
    "environment-version-qc": {},
    "capacity-plan": {"preset": "qwen3-8b", "concurrency": 2, "context": 1024},
    "alert-rule-list": {"name": "pwned", "kind": "nan_streak"},
    "alert-rule-detail": {"name": "pwned"},
    "eval-suite-list": {"slug": "pwned", "project": "main",
                        "entries": [{"environment": "acme-secret-env@v1"}]},
    "eval-suite-detail": {"name": "pwned"},
    "eval-suite-evaluate": {"base_model": "preset"},
    "checkpoint-promote": {"note": "pwned"},
    "sandbox-session-exec": {"cmd": "echo pwned > f"},
    "sandbox-session-files": {"path": "f", "data": "cHduZWQ="},
    "filter-policy": {"samples": "block"},
}
#: Team pages only admins may open (others get the page's 404, as outsiders do).
ADMIN_PAGES = {"team-audit"}
#: Columns legitimately written by a refused request (authentication bookkeeping).
VOLATILE = {"apitoken": {"last_used_at"}, "user": {"last_login"}}





def leaked(secrets: tuple[str, ...], text: str, url: str = "") -> list[str]:
    """The secrets that appear in ``text`` as whole words (not inside a longer run of word
    characters and dashes: a random CSRF or session token contains a three-letter name like
    "mia" once in a few thousand pages) and that the URL does not itself carry (echoes are fine)."""
    return [s for s in secrets if s not in url
            and re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text)]

@dataclass
class World:
    run: Run
    dataset: Dataset
    dataset_digest: str
    environment_slug: str
    environment_digest: str
    worker_prefix: str
    invitation_prefix: str
    execution_id: str | None
    batch_id: str | None
    item_id: str | None
    secrets: tuple[str, ...]
    rule_id: str = ""
    alert_id: str = ""
    delivery_id: str = ""
    checkpoint_id: str = ""
    suite_slug: str = ""
    evaluation_id: str = ""
    variant_id: str = ""
    session_id: str | None = None
    snapshot_id: str | None = None

    def kwargs(self, route: Route, team: str = "acme") -> dict[str, str]:
        values = {
            "team": team,
            "project": "main",
            "dataset": self.dataset.slug,
            "environment": self.environment_slug,
            "run": str(self.run.pk),
            "username": "mia",
            "prefix": (self.invitation_prefix if (route.name or "").startswith("invitation")
                       else self.worker_prefix),
            "execution": self.execution_id,
            "batch": self.batch_id,
            "item": self.item_id,
            "step": "1",
            "rule": self.rule_id,
            "alert": self.alert_id,
            "delivery": self.delivery_id,
            "checkpoint": self.checkpoint_id,
            "suite": self.suite_slug,
            "evaluation": self.evaluation_id,
            "variant": self.variant_id,
            "session": self.session_id,
            "snapshot": self.snapshot_id,
        }
        if "version" in route.groups:
            values["version"] = (self.environment_digest if "environment" in route.groups
                                 else self.dataset_digest)
        return {k: v for k, v in values.items() if k in route.groups}

    def url(self, route: Route, team: str = "acme") -> str:
        url = route.url(**self.kwargs(route, team))
        query = QUERY.get(route.name or "")
        return f"{url}?{query.format(run=self.run.pk)}" if query else url

    def worker_url(self, route: Route) -> str:
        # Nodes belong to no team (operator tokens only).
        values = {"run": str(self.run.pk), "execution": self.execution_id,
                  "name": "gpu-node-1", "delivery": self.delivery_id}
        return route.url(**{k: v for k, v in values.items() if k in route.groups})

    def body(self, route: Route | None = None) -> dict:
        """A body that is valid for the write (most endpoints ignore extra keys), so the
        owner's control request shows each refused write would otherwise succeed."""
        if route is not None and route.name in STRICT_BODIES:
            return STRICT_BODIES[route.name]
        if route is not None and route.name == "sandbox-session-restore":
            return {"snapshot": self.snapshot_id}
        if route is not None and route.name == "served-variant-list":
            return {"checkpoint": f"checkpoint:{self.checkpoint_id}", "kind": "int8"}
        return {
            "name": "pwned", "description": "pwned", "slug": "pwned", "project": "main",
            "username": "oscar", "role": Role.OWNER, "message": "pwned",
            "records": [{"prompt": "pwned", "answer": "0"}], "spec": {"image": "pwned"},
            "version": self.dataset_digest, "kind": "profile", "config": {},
            "datasets": [self.dataset.slug],
        }


@pytest.fixture
def world(team, project, owner, member) -> World:
    """acme with one of everything: a dataset with a version, an environment with a
    version, a queued run, a member 'mia' and a team worker token."""
    dataset = DatasetFactory(project=project, team=team, slug="acme-secret-ds")
    version = make_version(dataset, [{"prompt": "acme-secret-prompt", "answer": "42"}])
    dataset.refresh_from_db()
    env = environment_services.environment_create(
        actor=Actor.system(), team=team, project=project, slug="acme-secret-env"
    )
    env_version, _ = environment_services.version_create(
        actor=Actor.system(), environment=env, spec={"image": "acme/secret:1"}
    )
    run = make_run(project, dataset)
    report_uri = put_run_object(run, "report.json", b'{"text": "acme-secret-report"}')
    Run.objects.filter(pk=run.pk).update(report_uri=report_uri)
    checkpoint = Checkpoint.objects.create(run=run, team=team, step=1, uri=put_run_object(
        run, "checkpoints/step-1.tar", b"acme-secret-weights"))
    token, _ = worker_token_create(actor=Actor.system(), team=team, name="acme-pool")
    invitation, _ = team_services.invitation_create(actor=Actor.system(), team=team)
    execution_id = None
    if apps.is_installed("apps.sandbox"):  # a sandbox execution, where that app exists
        execution = apps.get_model("sandbox", "Execution").objects.create(
            team=team, language="python",
            request={"language": "python", "code": "print('acme-secret-code')"},
        )
        execution_id = str(execution.pk)
    session_id = snapshot_id = None
    if apps.is_installed("apps.sandbox"):  # a sandbox session and a snapshot of it (records
        # only: the owner's control requests start a real one, see _live_session)
        session = apps.get_model("sandbox", "SandboxSession").objects.create(
            team=team, engine_id="not-started", limits={})
        snap = apps.get_model("sandbox", "SandboxSnapshot").objects.create(
            team=team, session=session, engine_id="not-started")
        session_id, snapshot_id = str(session.pk), str(snap.pk)
    batch_id = item_id = None
    if apps.is_installed("apps.review"):  # a batch awaiting spot-check review
        from apps.review import services as review_services

        batch = review_services.batch_create(
            actor=Actor.system(), dataset=dataset, target_error_rate=0.5, confidence=0.9,
            records=[{"prompt": "acme-secret-batch-record", "answer": "1"}],
        )
        batch_id, item_id = str(batch.pk), str(batch.items.get().pk)
    rule_id = alert_id = delivery_id = ""
    if apps.is_installed("apps.alerts"):  # a rule with a webhook, its alert and delivery
        from apps.alerts.models import Alert, AlertRule, Delivery

        rule = AlertRule.objects.create(team=team, name="acme-secret-rule", kind="nan_streak",
                                        params={"streak": 2}, webhook_url="https://a.example/h",
                                        webhook_secret="whsec_" + "A" * 44)
        alert = Alert.objects.create(team=team, rule=rule, run=run, kind="nan_streak",
                                     key=f"run:{run.pk}", message="acme-secret-alert")
        delivery = Delivery.objects.create(team=team, alert=alert, url=rule.webhook_url,
                                           msg_id="msg_acme", payload={},
                                           status="succeeded")
        rule_id, alert_id, delivery_id = str(rule.pk), str(alert.pk), str(delivery.pk)
    suite_slug = evaluation_id = variant_id = ""
    if apps.is_installed("apps.evals"):  # an eval suite with one evaluation
        from apps.evals import services as eval_services

        suite = eval_services.suite_create(
            actor=Actor.system(), team=team, slug="acme-secret-suite", project="main",
            entries=[{"environment": f"{env.slug}@v{env_version.number}"}])
        evaluation = eval_services.evaluate(actor=Actor.system(), suite=suite,
                                            subject_kind="model", label="preset",
                                            base_model="preset")
        suite_slug, evaluation_id = suite.slug, str(evaluation.pk)
        variant_id = str(eval_services.variant_create(
            actor=Actor.system(), team=team, checkpoint=f"checkpoint:{checkpoint.pk}",
            kind="int8", label="acme-secret-variant").pk)
    return World(
        variant_id=variant_id,
        rule_id=rule_id, alert_id=alert_id, delivery_id=delivery_id,
        checkpoint_id=str(checkpoint.pk), suite_slug=suite_slug, evaluation_id=evaluation_id,
        run=run, dataset=dataset, dataset_digest=version.digest,
        environment_slug=env.slug, environment_digest=env_version.digest,
        worker_prefix=token.prefix, invitation_prefix=invitation.prefix,
        execution_id=execution_id, batch_id=batch_id,
        item_id=item_id, session_id=session_id, snapshot_id=snapshot_id,
        secrets=(*((batch_id, "acme-secret-batch-record") if batch_id else ()),
                 str(run.pk), dataset.slug, version.digest, env.slug, env_version.digest,
                 token.prefix, invitation.prefix, "acme-secret-prompt", "acme-secret-report",
                 "mia", "olivia", *(("acme-secret-rule", "acme-secret-alert")
                                    if rule_id else ()),
                 *((suite_slug, "acme-secret-variant") if suite_slug else ())),
    )


@pytest.fixture(scope="module")
def session_host():
    """A real session host (sandbox sessions need root and bubblewrap)."""
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    from workers.sandbox import session_host as host  # noqa: PLC0415
    from workers.sandbox import sessions

    with sessions.SessionManager() as manager:
        server = host.serve(host.SessionHost(manager, "cross-tenant"), ("127.0.0.1", 0))
        yield manager, f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        server.server_close()


def _live_session(request, world: World) -> None:
    """Give the world's session and snapshot records a real workspace on a session host."""
    manager, url = request.getfixturevalue("session_host")
    settings = request.getfixturevalue("settings")
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SESSION_HOST_URL": url,
                         "SESSION_HOST_TOKEN": "cross-tenant"}
    live = manager.create()
    request.addfinalizer(live.close)
    live.write("f", b"acme")
    snap_engine_id = live.snapshot()
    models = apps.get_model("sandbox", "SandboxSession"), apps.get_model("sandbox",
                                                                          "SandboxSnapshot")
    models[0].objects.filter(pk=world.session_id).update(engine_id=live.id)
    models[1].objects.filter(pk=world.snapshot_id).update(engine_id=snap_engine_id)


def snapshot() -> dict[str, list[dict]]:
    """Every row of every app model, minus columns that authentication itself writes."""
    rows = {}
    configs = [c for c in apps.get_app_configs() if c.name.startswith("apps.")]
    for config in [apps.get_app_config("auth"), *configs]:
        for model in config.get_models():
            skip = VOLATILE.get(model._meta.model_name, set())
            rows[model._meta.label] = [
                {k: v for k, v in row.items() if k not in skip}
                for row in model.objects.order_by("pk").values()
            ]
    return rows


def call(client: APIClient, method: str, url: str, body: dict | None = None,
         **headers: str):
    if method in ("get", "head", "options", "delete"):
        return getattr(client, method)(url, **headers)
    return getattr(client, method)(url, body or {}, format="json", **headers)


def _cases(routes: list[Route], extra: tuple[str, ...] = ()) -> list:
    cases = []
    for route in routes:
        methods = [*route.methods, *(m for m in extra if m != "head" or "get" in route.methods)]
        cases += [pytest.param(route, m, id=f"{route.name}:{m}") for m in methods]
    return cases


def _error_code(response) -> str | None:
    try:
        return response.json().get("code")
    except ValueError:
        return None


# --- the route list itself --------------------------------------------------------------


def test_matrix_covers_the_team_api():
    assert len(TEAM_ROUTES) >= 25
    written = {(r.name, m) for r in TEAM_ROUTES for m in r.methods if m != "get"}
    assert {("run-list", "post"), ("run-cancel", "post"), ("member-detail", "patch"),
            ("member-detail", "delete"), ("worker-token-detail", "delete"),
            ("team-detail", "patch"), ("dataset-set-current", "post")} <= written


def test_every_team_route_gets_a_concrete_url(world):
    for route in TEAM_ROUTES:
        url = world.url(route).partition("?")[0]
        assert resolve(url).func is route.callback, f"{route} built {url}"


# --- outsiders: 404 everywhere, nothing changes -----------------------------------------


@pytest.mark.parametrize(("route", "method"), _cases(TEAM_ROUTES, ("head", "options")))
def test_outsider_gets_404_and_changes_nothing(route, method, world, outsider):
    before = snapshot()
    response = call(outsider.client, method, world.url(route), world.body(route))
    assert response.status_code == 404, (route, method, response.content[:300])
    if method != "head":
        body = response.json()
        assert body["code"] == "not_found"
        assert not leaked(world.secrets, response.content.decode())
    assert snapshot() == before


@pytest.mark.parametrize(("route", "method"), _cases(TEAM_ROUTES))
def test_owner_control_request_succeeds(route, method, world, owner, outsider, request):
    """The same request by acme's owner succeeds, so each 404 above is the tenant check,
    not a wrong URL or a bad body. (``outsider`` exists: the body adds user 'oscar'.)"""
    if (route.name or "").startswith("sandbox-s"):
        _live_session(request, world)
    response = call(owner.client, method, world.url(route), world.body(route))
    assert 200 <= response.status_code < 300 or (route.name, response.status_code) in {
        ("run-resume", 409),  # a queued run cannot be resumed; the lookup still succeeded
        ("review-item-undo", 409),  # the item has no verdict to undo; the lookup succeeded
        ("team-queue", 403),  # only staff set a queue (quota); the team lookup succeeded
    }, (route, method, response.status_code, response.content[:300])


@pytest.mark.parametrize(
    ("route", "method"),
    _cases([r for r in TEAM_ROUTES if r.groups - {"team"}], ("head",)),
)
def test_acme_objects_through_outsiders_own_team_url_are_404(route, method, world, outsider):
    """rival's URLs with acme's object ids: the object lookup is scoped too."""
    before = snapshot()
    response = call(outsider.client, method, world.url(route, team="rival"), world.body(route))
    if route.name == "team-detail":  # the object *is* the team: rival's own team
        assert response.status_code in (200, 201)
        return
    assert response.status_code == 404, (route, method, response.content[:300])
    assert snapshot() == before


@pytest.mark.parametrize(
    "route", [r for r in TEAM_ROUTES if "get" in r.methods and r.groups == {"team"}],
    ids=lambda r: r.name,
)
def test_outsiders_own_lists_never_show_acme_data(route, world, outsider):
    url = world.url(route, team="rival")
    response = outsider.client.get(url)
    expected = 404 if route.name in LOOKUPS_BY_QUERY else 200
    assert response.status_code == expected, (route, response.content[:300])
    text = response.content.decode()
    found = leaked(world.secrets, text, url)
    assert found == [], (route, found)


def test_lineage_of_acme_run_through_rival_is_empty(world, owner, outsider):
    query = f"?artifact=run:{world.run.pk}"
    ours = owner.client.get(f"/api/v1/teams/acme/lineage{query}").json()
    assert ours["edges"], "control: acme's run has lineage edges"
    theirs = outsider.client.get(f"/api/v1/teams/rival/lineage{query}").json()
    assert theirs["edges"] == []
    assert theirs["nodes"] == [{"type": "run", "id": str(world.run.pk)}]


def test_outsider_sees_no_acme_team_anywhere(world, outsider):
    me = outsider.client.get("/api/v1/me").json()
    assert [t["slug"] for t in me["teams"]] == ["rival"]
    mine = outsider.client.get("/api/v1/teams").json()
    assert [t["slug"] for t in mine] == ["rival"]
    missing = outsider.client.get("/api/v1/teams/no-such-team/runs")
    acme = outsider.client.get("/api/v1/teams/acme/runs")
    assert missing.status_code == acme.status_code == 404
    # "not yours" reads exactly like "does not exist" (no existence oracle)
    assert acme.json()["message"].replace("acme", "X") == \
        missing.json()["message"].replace("no-such-team", "X")


def test_unknown_object_ids_are_404_not_500(world, owner):
    for url in ("/api/v1/teams/acme/runs/not-a-uuid",
                "/api/v1/teams/acme/runs/00000000-0000-4000-8000-000000000000/events",
                "/api/v1/teams/acme/datasets/nope/versions/v9",
                "/api/v1/teams/acme/environments/nope/versions",
                "/api/v1/teams/acme/members/nobody",
                "/api/v1/teams/acme/worker-tokens/abcdef"):
        response = owner.client.get(url)
        assert response.status_code == 404, (url, response.content[:200])


# --- worker tokens on team URLs, personal tokens on worker URLs -------------------------


@pytest.fixture(params=["operator", "acme"])
def any_worker(request, world, worker, team) -> APIClient:
    """An operator worker token, and acme's own team worker token."""
    if request.param == "operator":
        return worker
    _, raw = worker_token_create(actor=Actor.system(), team=team, name="acme-own")
    return client_for_token(raw)


@pytest.mark.parametrize(("route", "method"), _cases(TEAM_ROUTES))
def test_worker_token_on_team_url_is_403(route, method, world, any_worker):
    before = snapshot()
    response = call(any_worker, method, world.url(route), world.body(route))
    assert response.status_code == 403, (route, method, response.content[:300])
    assert response.json()["code"] == "forbidden"
    assert snapshot() == before


@pytest.mark.parametrize("url", ["/api/v1/teams", "/api/v1/tokens"])
def test_worker_token_on_user_endpoints_is_403(url, any_worker):
    assert any_worker.get(url).status_code == 403
    assert any_worker.post(url, {"name": "x", "slug": "x"}, format="json").status_code == 403


@pytest.mark.parametrize(("route", "method"), _cases(WORKER_ROUTES))
def test_personal_token_on_worker_url_is_403(route, method, world, owner):
    before = snapshot()
    response = call(owner.client, method, world.worker_url(route),
                    {"pool": "cpu", "worker_id": "w"})
    assert response.status_code == 403, (route, method, response.content[:300])
    assert response.json()["code"] == "forbidden"
    assert snapshot() == before


def test_session_user_on_worker_url_is_403(world, owner):
    client = APIClient()
    client.force_login(owner.user)
    response = client.get(f"/api/v1/worker/runs/{world.run.pk}")
    assert response.status_code == 403


# --- no credentials ---------------------------------------------------------------------


@pytest.mark.parametrize(("route", "method"), _cases(TEAM_ROUTES + WORKER_ROUTES))
def test_unauthenticated_is_401(route, method, world):
    before = snapshot()
    url = world.url(route) if route in TEAM_ROUTES else world.worker_url(route)
    response = call(APIClient(), method, url, world.body(route))
    assert response.status_code == 401, (route, method, response.content[:300])
    assert response["WWW-Authenticate"] == "Bearer"
    assert snapshot() == before


@pytest.mark.parametrize("url", ["/api/v1/me", "/api/v1/teams", "/api/v1/tokens"])
def test_unauthenticated_user_endpoints_are_401(url, db):
    assert APIClient().get(url).status_code == 401


@pytest.mark.parametrize("header", ["Bearer crc_nope_nope", "Bearer garbage", "Bearer ",
                                    "Bearer crw_abc_def"])
def test_bad_credentials_are_401_on_team_urls(header, world):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert client.get("/api/v1/teams/acme/runs").status_code == 401


# --- team-scoped worker tokens ----------------------------------------------------------


@pytest.fixture
def rival_worker(other_team) -> APIClient:
    _, raw = worker_token_create(actor=Actor.system(), team=other_team, name="rival-pool")
    return client_for_token(raw)


def test_other_teams_worker_token_cannot_claim_or_see_acme_run(world, rival_worker, worker):
    run = world.run
    before = snapshot()
    claim = rival_worker.post("/api/v1/worker/claim", {"pool": run.pool, "worker_id": "r1"},
                              format="json")
    assert claim.status_code == 204
    pinned = rival_worker.post("/api/v1/worker/claim",
                               {"pool": run.pool, "worker_id": "r1", "run_id": str(run.pk)},
                               format="json")
    assert pinned.status_code == 204
    assert rival_worker.get(f"/api/v1/worker/runs/{run.pk}").status_code == 404
    assert snapshot() == before
    run.refresh_from_db()
    assert run.status == "queued" and run.lease_id in ("", None)

    # Control: the operator's pool token does get it.
    got = worker.post("/api/v1/worker/claim", {"pool": run.pool, "worker_id": "op"},
                      format="json")
    assert got.status_code == 200 and got.json()["id"] == str(run.pk)


def test_acmes_own_worker_token_claims_acme_run(world, team):
    _, raw = worker_token_create(actor=Actor.system(), team=team, name="acme-own")
    client = client_for_token(raw)
    got = client.post("/api/v1/worker/claim", {"pool": world.run.pool, "worker_id": "a1"},
                      format="json")
    assert got.status_code == 200 and got.json()["id"] == str(world.run.pk)
    assert client.get(f"/api/v1/worker/runs/{world.run.pk}").status_code == 200


@pytest.mark.parametrize("route", [r for r in WORKER_ROUTES if r.groups & {"run", "execution"}],
                         ids=lambda r: r.name)
def test_other_teams_worker_token_gets_404_on_every_acme_object(
    route, world, rival_worker, worker
):
    # Even with acme's run leased and the lease id known, rival's token cannot touch it.
    claim = worker.post("/api/v1/worker/claim", {"pool": world.run.pool, "worker_id": "op"},
                        format="json").json()
    before = snapshot()
    body = {"status": "running", "seq": 1, "points": [{"name": "x", "step": 0, "value": 1}],
            "events": [{"message": "pwned"}], "step": 1, "uri": "file:///pwned",
            "samples": [{"step": 0, "prompt": "p", "completion": "c"}], "kind": "report",
            "result": {"verdict": "OK"}}
    for method in route.methods:
        response = call(rival_worker, method, world.worker_url(route), body,
                        HTTP_X_CRUCIBLE_LEASE=claim["lease_id"])
        assert response.status_code == 404, (route, method, response.content[:300])
    assert snapshot() == before


def test_execution_start_control(world, worker, rival_worker):
    """The operator's token starts acme's execution, so rival's 404 is the team filter."""
    if world.execution_id is None:
        pytest.skip("no sandbox app")
    url = f"/api/v1/worker/executions/{world.execution_id}/start"
    assert rival_worker.post(url).status_code == 404
    assert worker.post(url).status_code == 200


def test_counts_unchanged_after_outsider_sweep(world, outsider):
    """A coarse, readable double-check of the snapshot: outsider hammers every write."""
    counts = (Run.objects.count(), Dataset.objects.count(), Membership.objects.count(),
              ApiToken.objects.filter(revoked_at__isnull=True).count())
    for route in TEAM_ROUTES:
        for method in route.methods:
            if method != "get":
                call(outsider.client, method, world.url(route), world.body(route))
    assert (Run.objects.count(), Dataset.objects.count(), Membership.objects.count(),
            ApiToken.objects.filter(revoked_at__isnull=True).count()) == counts
    world.run.refresh_from_db()
    assert world.run.status == "queued"


# --- dashboard pages (HTML, session login) ----------------------------------------------


def _session(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


def test_there_are_team_pages_to_check():
    assert {r.name for r in TEAM_PAGES} >= {"team-runs", "run-page"}


@pytest.mark.parametrize("route", TEAM_PAGES, ids=lambda r: r.name)
def test_team_page_is_404_for_outsider_and_200_for_member(route, world, outsider, viewer,
                                                         owner):
    url = world.url(route)
    mine = _session(owner if route.name in ADMIN_PAGES else viewer).get(url)
    assert mine.status_code == 200, (route, mine.status_code)
    before = snapshot()
    theirs = _session(outsider).get(url)
    assert theirs.status_code == 404, (route, theirs.status_code)
    text = theirs.content.decode()
    assert not leaked(world.secrets, text, url)
    assert snapshot() == before


@pytest.mark.parametrize("route", TEAM_PAGES, ids=lambda r: r.name)
def test_team_page_through_outsiders_own_team_shows_no_acme_data(route, world, outsider):
    url = world.url(route, team="rival")
    response = _session(outsider).get(url)
    expected = 404 if route.groups - {"team"} else 200  # acme's objects are not rival's
    assert response.status_code == expected, (route, response.status_code)
    text = response.content.decode()
    assert not leaked(world.secrets, text, url)


@pytest.mark.parametrize("route", TEAM_PAGES, ids=lambda r: r.name)
def test_team_page_needs_a_login(route, world, owner):
    response = Client().get(world.url(route))
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    # A bearer token is an API credential, not a dashboard login.
    bearer = Client(HTTP_AUTHORIZATION=f"Bearer {owner.token}").get(world.url(route))
    assert bearer.status_code == 302
