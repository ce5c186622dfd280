"""URL map. Everything under ``/api/v1/teams/<team>/`` is a TeamScopedViewSet; everything
under ``/api/v1/worker/`` is a WorkerViewSet, routed in config/worker_urls.py
(tests/apps/api/test_urlconf.py enforces both)."""

from __future__ import annotations

from csp.decorators import csp_update
from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import SimpleRouter

from apps.alerts.api import AlertRuleViewSet, AlertViewSet, DeliveryViewSet
from apps.capacity.api import CapacityViewSet
from apps.core import views as core_views
from apps.datasets.api import DatasetVersionViewSet, DatasetViewSet
from apps.environments.api import EnvironmentViewSet
from apps.evals.api import (
    CheckpointGateViewSet,
    EvalSuiteViewSet,
    ServedVariantViewSet,
    SuiteEvaluationViewSet,
)
from apps.filtering import views as filtering_views
from apps.filtering.api import FilterPolicyViewSet, FindingViewSet
from apps.lineage.api import LineageViewSet
from apps.ops import views as ops_views
from apps.projects.api import ProjectViewSet
from apps.runs import queue_pages
from apps.runs import views as run_views
from apps.runs.api import RunViewSet
from apps.runs.environment_api import EnvironmentVersionRunsViewSet
from apps.runs.queue_api import ClusterQueueView
from apps.sandbox.api import ExecutionViewSet, SandboxSessionViewSet, SandboxSnapshotViewSet
from apps.scheduling.api import NodeViewSet, TeamQueueViewSet
from apps.teams import views as team_views
from apps.teams.api import (
    InvitationAcceptView,
    InvitationViewSet,
    MembershipViewSet,
    MeView,
    MyTeamsViewSet,
    PersonalTokenViewSet,
    TeamViewSet,
    WorkerTokenViewSet,
)
from apps.teams.audit_api import AuditLogViewSet
from apps.usage import views as usage_views
from apps.usage.api import UsageViewSet

TEAM = r"teams/(?P<team>[-a-zA-Z0-9_]+)"

class Router(SimpleRouter):
    """API paths work with and without a trailing slash (clients differ; no redirects)."""

    def __init__(self) -> None:
        super().__init__()
        self.trailing_slash = "/?"


router = Router()
router.register(r"teams", MyTeamsViewSet, basename="my-teams")
router.register(r"tokens", PersonalTokenViewSet, basename="personal-token")
router.register(rf"{TEAM}/members", MembershipViewSet, basename="member")
router.register(rf"{TEAM}/worker-tokens", WorkerTokenViewSet, basename="worker-token")
router.register(rf"{TEAM}/invitations", InvitationViewSet, basename="invitation")
router.register(rf"{TEAM}/projects", ProjectViewSet, basename="project")
router.register(rf"{TEAM}/datasets", DatasetViewSet, basename="dataset")
router.register(rf"{TEAM}/datasets/(?P<dataset>[-a-zA-Z0-9_]+)/versions", DatasetVersionViewSet,
                basename="dataset-version")
router.register(rf"{TEAM}/environments", EnvironmentViewSet, basename="environment")
router.register(rf"{TEAM}/environments/(?P<environment>[-a-zA-Z0-9_]+)/versions",
                EnvironmentVersionRunsViewSet, basename="environment-version")
router.register(rf"{TEAM}/runs", RunViewSet, basename="run")
router.register(rf"{TEAM}/lineage", LineageViewSet, basename="lineage")
router.register(rf"{TEAM}/executions", ExecutionViewSet, basename="execution")
router.register(rf"{TEAM}/sandbox-sessions", SandboxSessionViewSet, basename="sandbox-session")
router.register(rf"{TEAM}/sandbox-snapshots", SandboxSnapshotViewSet,
                basename="sandbox-snapshot")
router.register(rf"{TEAM}/audit-log", AuditLogViewSet, basename="audit-log")
router.register(rf"{TEAM}/capacity", CapacityViewSet, basename="capacity")
router.register(rf"{TEAM}/usage", UsageViewSet, basename="usage")
router.register(rf"{TEAM}/alert-rules", AlertRuleViewSet, basename="alert-rule")
router.register(rf"{TEAM}/alerts", AlertViewSet, basename="alert")
router.register(rf"{TEAM}/webhook-deliveries", DeliveryViewSet, basename="webhook-delivery")
router.register(rf"{TEAM}/evals/suites", EvalSuiteViewSet, basename="eval-suite")
router.register(rf"{TEAM}/evals/evaluations", SuiteEvaluationViewSet, basename="suite-evaluation")
router.register(rf"{TEAM}/checkpoints", CheckpointGateViewSet, basename="checkpoint")
router.register(rf"{TEAM}/variants", ServedVariantViewSet, basename="served-variant")
router.register(rf"{TEAM}/filtering/findings", FindingViewSet, basename="filter-finding")
router.register(r"cluster/nodes", NodeViewSet, basename="cluster-node")

api_v1 = [
    path("me", MeView.as_view(), name="me"),
    path("invitations/accept", InvitationAcceptView.as_view(), name="invitation-accept"),
    re_path(rf"^{TEAM}/?$", TeamViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
            name="team-detail"),
    re_path(rf"^{TEAM}/filtering/policy/?$",
            FilterPolicyViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
            name="filter-policy"),
    re_path(rf"^{TEAM}/queue/?$",
            TeamQueueViewSet.as_view({"get": "retrieve", "put": "update"}), name="team-queue"),
    path("cluster/queue", ClusterQueueView.as_view(), name="cluster-queue"),
    path("worker/", include("config.worker_urls")),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up code as a script file, not inline (CSP);
    # Swagger UI itself sets style attributes, so this one page allows inline styles (never
    # inline scripts).
    path("docs", csp_update({"style-src": ["'unsafe-inline'"]})(
        SpectacularSwaggerSplitView.as_view(url_name="schema")), name="docs"),
    *router.urls,
]

urlpatterns = [
    # First: Django tries patterns in order, and the API (workers' metric batches, heartbeats,
    # automation) is what is called at high rate. Behind the ~200 page patterns its URLs
    # cost ~10% of a metric batch's web-process time in URL resolution (py-spy). No page
    # pattern can match a path under api/v1/ (test_urlconf.py), so the order changes nothing
    # else.
    path("api/v1/", include(api_v1)),
    path("", run_views.home, name="home"),
    path("t/<slug:team>/", run_views.team_runs, name="team-runs"),
    path("t/<slug:team>/projects/", run_views.team_projects, name="team-projects"),
    path("t/<slug:team>/runs/<str:run>/", run_views.run_detail, name="run-page"),
    path("t/<slug:team>/", include("apps.runs.page_urls")),
    path("", include("apps.datasets.urls")),
    path("", include("apps.review.urls")),
    path("", include("apps.environments.urls")),
    path("", include("apps.capacity.urls")),
    path("t/<slug:team>/usage/", usage_views.usage_page, name="usage-page"),
    path("", include("apps.alerts.urls")),
    path("", include("apps.evals.urls")),
    path("t/<slug:team>/filtering/", filtering_views.filtering_page, name="team-filtering"),
    path("cluster/queue/", queue_pages.queue_page, name="cluster-queue-page"),
    path("", include("apps.scheduling.urls")),
    path("healthz", core_views.healthz, name="healthz"),
    path("readyz", ops_views.readyz, name="readyz"),
    path("metrics", ops_views.metrics, name="metrics"),
    path("invite/", team_views.accept_invitation, name="invite-accept"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("admin/", admin.site.urls),
]

handler400 = "apps.core.errors.bad_request"
handler404 = "apps.teams.views.not_found"
handler500 = "apps.core.errors.server_error"
