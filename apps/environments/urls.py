"""Environment routes outside the team router: the worker hand-over of a QC run's report,
and the dashboard pages (the environment API is routed in config/urls.py). Included from
config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.environments import views
from apps.environments.worker_api import WorkerQcViewSet

urlpatterns = [
    path("api/v1/worker/runs/<str:run>/qc", WorkerQcViewSet.as_view({"post": "create"}),
         name="worker-qc"),
    path("t/<slug:team>/environments/", views.environment_list, name="team-environments"),
    path("t/<slug:team>/environments/<slug:environment>/", views.environment_detail,
         name="environment-page"),
    path("t/<slug:team>/environments/<slug:environment>/<str:version>/",
         views.version_detail, name="environment-version-page"),
]
