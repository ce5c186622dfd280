"""The URL map is the tenant boundary: every ``<team>`` API URL goes through
TeamScopedViewSet, every worker URL through WorkerViewSet, and nothing else lives under
``/api/v1/`` without being listed here on purpose. Server-rendered dashboard pages with a
``<team>`` (outside the API) must be listed in TEAM_PAGES; test_cross_tenant.py checks each.

The walker below is also used by test_cross_tenant.py, so a new endpoint is covered by the
cross-tenant matrix as soon as it is routed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from django.urls import URLPattern, URLResolver, get_resolver, path, re_path
from django.urls import include as url_include
from django.utils.regex_helper import normalize
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework import viewsets
from rest_framework.views import APIView

from apps.alerts import views as alert_views
from apps.capacity import views as capacity_views
from apps.datasets import views as dataset_views
from apps.environments import views as environment_views
from apps.evals import views as eval_views
from apps.filtering import views as filtering_views
from apps.review import dataset_pages
from apps.review import views as review_views
from apps.runs import environment_pages
from apps.runs import views as run_views
from apps.runs.queue_api import ClusterQueueView
from apps.scheduling.api import NodeViewSet
from apps.teams import views as team_views
from apps.teams.api import InvitationAcceptView, MeView, MyTeamsViewSet, PersonalTokenViewSet
from apps.teams.viewsets import TeamScopedViewSet, WorkerViewSet
from apps.usage import views as usage_views

API_PREFIX = "api/v1/"
WORKER_PREFIX = "api/v1/worker/"

#: The only /api/v1/ views that are neither team-scoped nor worker-only: (url name, class).
ALLOWED_UNSCOPED = {
    ("me", MeView),
    # Joining a team by invite code: the code names the team; the caller acts as themself.
    ("invitation-accept", InvitationAcceptView),
    ("my-teams-list", MyTeamsViewSet),
    ("personal-token-list", PersonalTokenViewSet),
    ("personal-token-detail", PersonalTokenViewSet),
    # The cluster inventory: nodes serve every team; reading is open to anyone signed in,
    # acting on a node is for staff (apps/scheduling/api.py).
    ("cluster-node-list", NodeViewSet),
    ("cluster-node-detail", NodeViewSet),
    ("cluster-node-cordon", NodeViewSet),
    ("cluster-node-drain", NodeViewSet),
    ("cluster-node-uncordon", NodeViewSet),
    # What waits for the cluster: every queue's counts for anyone signed in, the runs only of
    # the caller's teams (all for staff) (apps/runs/queue_api.py).
    ("cluster-queue", ClusterQueueView),
    ("schema", SpectacularAPIView),
    ("docs", SpectacularSwaggerSplitView),
}

#: Dashboard pages (HTML, session login) with a <team> outside /api/v1/: (url name, view).
#: Each scopes through apps.teams.access.access_team; test_cross_tenant.py proves it.
TEAM_PAGES = {
    ("team-runs", run_views.team_runs),
    ("team-projects", run_views.team_projects),
    ("run-page", run_views.run_detail),
    ("team-datasets", dataset_views.dataset_list),
    ("dataset-page", dataset_pages.dataset_detail),
    ("dataset-diff-page", dataset_views.dataset_diff),
    ("dataset-rollback-page", dataset_views.dataset_rollback),
    ("review-queue", review_views.review_queue),
    ("run-launch", run_views.run_launch),
    ("runs-compare", run_views.run_compare),
    ("run-page-samples", run_views.run_samples),
    ("run-page-parts", run_views.run_parts),
    ("dataset-records-page", dataset_views.dataset_records),
    ("dataset-upload-page", dataset_views.dataset_upload),
    ("team-page", team_views.team_page),
    ("team-audit", team_views.audit_page),
    ("team-environments", environment_views.environment_list),
    ("environment-page", environment_views.environment_detail),
    ("environment-version-page", environment_pages.version_detail),
    ("capacity-page", capacity_views.planner),
    ("usage-page", usage_views.usage_page),
    ("alerts-page", alert_views.alerts_page),
    ("evals-page", eval_views.suite_list),
    ("eval-suite-page", eval_views.leaderboard),
    ("team-filtering", filtering_views.filtering_page),
}


@dataclass(frozen=True)
class Route:
    """One URLPattern with everything its enclosing resolvers contribute."""

    text: str  # human-readable full route, e.g. "api/v1/^teams/(?P<team>...)/runs/?$"
    regex: str  # the full regex, as Django's reverse() builds it
    groups: frozenset[str]
    pattern: URLPattern = field(compare=False)

    @property
    def name(self) -> str | None:
        return self.pattern.name

    @property
    def callback(self):
        return self.pattern.callback

    @property
    def view_class(self) -> type | None:
        callback = self.pattern.callback
        return getattr(callback, "cls", None) or getattr(callback, "view_class", None)

    @property
    def actions(self) -> dict[str, str]:
        return dict(getattr(self.pattern.callback, "actions", None) or {})

    @property
    def methods(self) -> list[str]:
        """Lower-case HTTP methods this route serves (HEAD implied by GET)."""
        if self.actions:
            found = set(self.actions) - {"head", "options"}
        else:
            cls = self.view_class
            found = {
                m for m in ("get", "post", "put", "patch", "delete")
                if cls is not None and hasattr(cls, m)
            }
        return sorted(found)

    def url(self, **kwargs: str) -> str:
        """A concrete path for this route, e.g. ``/api/v1/teams/acme/runs/<id>``."""
        (template, params), *_ = normalize(self.regex)
        missing = set(params) - set(kwargs)
        if missing:
            raise KeyError(f"{self.text}: no value for {sorted(missing)}")
        return "/" + template % {p: kwargs[p] for p in params}

    def __str__(self) -> str:
        return f"{self.name or '<unnamed>'} {self.text}"


def _regex(pattern: URLPattern | URLResolver) -> str:
    regex = pattern.pattern.regex.pattern
    return regex[1:] if regex.startswith("^") else regex


def iter_routes(
    patterns: list | None = None, text: str = "", regex: str = "", groups: frozenset = frozenset()
):
    """Every URLPattern in the URLconf (recursing through includes)."""
    if patterns is None:
        patterns = get_resolver().url_patterns
    for pattern in patterns:
        own_groups = groups | frozenset(pattern.pattern.regex.groupindex)
        own_text = text + str(pattern.pattern)
        own_regex = regex + _regex(pattern)
        if isinstance(pattern, URLResolver):
            yield from iter_routes(pattern.url_patterns, own_text, own_regex, own_groups)
        else:
            yield Route(own_text, own_regex, own_groups, pattern)


def _subclass(cls: type | None, base: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, base)


def violations(routes) -> list[str]:
    """Every way ``routes`` breaks the tenant rules, as readable lines."""
    problems = []
    for route in routes:
        cls = route.view_class
        team_scoped = _subclass(cls, TeamScopedViewSet)
        worker_only = _subclass(cls, WorkerViewSet)
        label = f"{route} -> {getattr(cls, '__qualname__', route.callback)}"
        in_api = route.text.startswith(API_PREFIX)
        if "team" in route.groups and not team_scoped:
            if in_api:
                problems.append(f"{label}: has <team> but is not a TeamScopedViewSet")
            elif (route.name, route.callback) not in TEAM_PAGES:
                problems.append(f"{label}: page with <team> is not listed in TEAM_PAGES")
        if team_scoped and "team" not in route.groups:
            problems.append(f"{label}: TeamScopedViewSet served without a <team> group")
        if route.text.startswith(WORKER_PREFIX) and not worker_only:
            problems.append(f"{label}: under {WORKER_PREFIX} but not a WorkerViewSet")
        if worker_only and not route.text.startswith(WORKER_PREFIX):
            problems.append(f"{label}: WorkerViewSet served outside {WORKER_PREFIX}")
        if (
            in_api
            and not (team_scoped or worker_only)
            and (route.name, cls) not in ALLOWED_UNSCOPED
        ):
            problems.append(f"{label}: not team-scoped, not worker-only, not allow-listed")
    return problems


def team_routes() -> list[Route]:
    """Team-scoped API routes."""
    return [r for r in iter_routes() if "team" in r.groups and r.text.startswith(API_PREFIX)]


def team_pages() -> list[Route]:
    """Dashboard pages with a <team>, outside the API."""
    return [r for r in iter_routes()
            if "team" in r.groups and not r.text.startswith(API_PREFIX)]


def worker_routes() -> list[Route]:
    return [r for r in iter_routes() if r.text.startswith(WORKER_PREFIX)]


# --- the real URLconf -------------------------------------------------------------------


def test_urlconf_obeys_the_tenant_rules():
    routes = list(iter_routes())
    assert len(routes) > 40  # the walk really went through the includes
    assert violations(routes) == []


def test_walk_finds_team_and_worker_routes():
    teams = team_routes()
    workers = worker_routes()
    names = {r.name for r in teams}
    assert {"team-detail", "member-detail", "worker-token-detail", "run-cancel",
            "dataset-version-records", "environment-version-detail", "lineage-list"} <= names
    assert {r.name for r in workers} >= {"worker-claim", "worker-sweep", "worker-run"}
    assert all(_subclass(r.view_class, TeamScopedViewSet) for r in teams)
    assert all(_subclass(r.view_class, WorkerViewSet) for r in workers)


def test_allow_list_is_tight():
    """Every allow-listed (name, class) is really routed under /api/v1/, so the list cannot
    silently keep a stale entry that a new view could later reuse."""
    routed = {(r.name, r.view_class) for r in iter_routes() if r.text.startswith(API_PREFIX)}
    assert routed >= ALLOWED_UNSCOPED
    pages = {(r.name, r.callback) for r in team_pages()}
    assert pages == TEAM_PAGES


def test_every_team_page_declares_its_roles_through_team_page():
    """Pages get the API's locked base: each resolves its team and checks the role per HTTP
    method in ``apps.teams.pages.team_page`` before its own code runs."""
    undeclared = sorted(name for name, view in TEAM_PAGES if not hasattr(view, "team_roles"))
    assert undeclared == []


def test_route_url_builds_resolvable_paths():
    from django.urls import resolve

    route = next(r for r in iter_routes() if r.name == "run-cancel")
    url = route.url(team="acme", run="0d9c7f4e-0000-4000-8000-000000000000")
    assert url == "/api/v1/teams/acme/runs/0d9c7f4e-0000-4000-8000-000000000000/cancel"
    assert resolve(url).func is route.callback
    with pytest.raises(KeyError):
        route.url(team="acme")


# --- the checker itself catches each kind of mistake ------------------------------------


class _PlainView(APIView):
    def get(self, request):
        raise AssertionError("never called")


class _PlainViewSet(viewsets.GenericViewSet):
    def list(self, request, **kwargs):
        raise AssertionError("never called")


class _ScopedViewSet(TeamScopedViewSet):
    def list(self, request, **kwargs):
        raise AssertionError("never called")


class _WorkerOnly(WorkerViewSet):
    def list(self, request, **kwargs):
        raise AssertionError("never called")


def _fake_team_view(request, team):
    raise AssertionError("never called")


def _check(*patterns) -> list[str]:
    return violations(iter_routes([path("api/v1/", url_include(list(patterns)))]))


@pytest.mark.parametrize(
    "pattern",
    [
        re_path(r"^teams/(?P<team>[-\w]+)/things/?$", _PlainViewSet.as_view({"get": "list"}),
                name="x"),
        path("teams/<str:team>/plain", _PlainView.as_view(), name="x"),
        path("teams/<str:team>/fn", _fake_team_view, name="x"),
        path("worker/thing", _PlainViewSet.as_view({"get": "list"}), name="x"),
        path("worker/scoped/<str:team>", _ScopedViewSet.as_view({"get": "list"}), name="x"),
        path("stuff", _PlainView.as_view(), name="stuff"),
        path("me", _PlainView.as_view(), name="me"),  # allow-listed name, wrong class
        path("unscoped", _ScopedViewSet.as_view({"get": "list"}), name="x"),
        path("other/worker", _WorkerOnly.as_view({"get": "list"}), name="x"),
        path("teams/<str:team>/page", run_views.team_runs, name="team-runs"),
    ],
    ids=["viewset-with-team", "apiview-with-team", "function-with-team", "worker-not-worker",
         "worker-with-team-view", "unlisted-api-view", "allow-listed-name-wrong-class",
         "scoped-without-team", "worker-view-elsewhere", "listed-page-inside-api"],
)
def test_checker_reports_bad_routes(pattern):
    assert _check(pattern) != []


def test_checker_reports_unlisted_team_pages():
    page = path("t/<str:team>/secret/", _fake_team_view, name="team-secret")
    assert _check_root(page) != []
    listed = path("t/<str:team>/", run_views.team_runs, name="team-runs")
    assert _check_root(listed) == []
    renamed = path("t/<str:team>/", run_views.team_runs, name="other-name")
    assert _check_root(renamed) != []


def _check_root(*patterns) -> list[str]:
    return violations(iter_routes(list(patterns)))


def test_checker_sees_team_group_from_an_enclosing_include():
    inner = [path("things", _PlainViewSet.as_view({"get": "list"}), name="x")]
    problems = _check(path("teams/<str:team>/", url_include(inner)))
    assert problems and "has <team>" in problems[0]


def test_checker_accepts_good_routes():
    assert _check(
        path("teams/<str:team>/things", _ScopedViewSet.as_view({"get": "list"}), name="x"),
        path("worker/things", _WorkerOnly.as_view({"get": "list"}), name="x"),
        path("me", MeView.as_view(), name="me"),
    ) == []


# --- the locked methods -----------------------------------------------------------------


@pytest.mark.parametrize("method", ["get_queryset", "initial", "get_object",
                                    "check_team_access"])
def test_subclass_overriding_a_locked_method_is_refused(method):
    def override(self, *args, **kwargs):
        return None

    with pytest.raises(TypeError, match=method):
        type("Sneaky", (TeamScopedViewSet,), {method: override})


@pytest.mark.parametrize("method", ["get_queryset", "initial", "get_object"])
def test_locked_method_overridden_through_a_mixin_is_refused(method):
    """A mixin placed before the base in the MRO overrides just as well as the class body."""

    def override(self, *args, **kwargs):
        return None

    mixin = type("Mixin", (), {method: override})
    with pytest.raises(TypeError, match=method):
        type("Sneaky", (mixin, TeamScopedViewSet), {})


def test_locked_method_overridden_in_a_grandchild_is_refused():
    class Child(TeamScopedViewSet):
        pass

    with pytest.raises(TypeError, match="get_queryset"):
        class GrandChild(Child):
            def get_queryset(self):
                return None


def test_subclass_may_override_base_queryset():
    class Fine(TeamScopedViewSet):
        def base_queryset(self):
            return None

    assert Fine.get_queryset is TeamScopedViewSet.get_queryset


def test_worker_viewset_refuses_initial_override():
    def initial(self, request, *args, **kwargs):
        return None

    with pytest.raises(TypeError, match="initial"):
        type("Sneaky", (WorkerViewSet,), {"initial": initial})
    mixin = type("Mixin", (), {"initial": initial})
    with pytest.raises(TypeError, match="initial"):
        type("Sneaky", (mixin, WorkerViewSet), {})


def test_api_routes_come_first_and_no_page_route_can_take_an_api_path():
    """``api/v1/`` is the URLconf's first entry (metric batches and heartbeats resolve
    without trying every page pattern first), which is only safe while no page route can
    match a path under it: each must begin with a literal that is not under ``api/v1/``."""
    first = get_resolver().url_patterns[0]
    assert isinstance(first, URLResolver) and str(first.pattern) == API_PREFIX
    pages = [r for r in iter_routes() if not r.text.startswith(API_PREFIX)]
    assert len(pages) > 100
    for route in pages:
        (template, _), *_ = normalize(route.regex)
        literal = template.split("%(", 1)[0]
        assert literal or not template, f"{route}: begins with a parameter"
        if template:
            assert not literal.startswith(API_PREFIX) and not API_PREFIX.startswith(literal), \
                f"{route}: could match a path under /{API_PREFIX}"
