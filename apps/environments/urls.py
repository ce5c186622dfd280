"""Environment routes outside the team router: the worker hand-over of a QC run's report.
Included from config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.environments.worker_api import WorkerQcViewSet

urlpatterns = [
    path("api/v1/worker/runs/<str:run>/qc", WorkerQcViewSet.as_view({"post": "create"}),
         name="worker-qc"),
]
