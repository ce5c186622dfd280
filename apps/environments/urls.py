"""Environment dashboard pages (the environment API is routed in config/urls.py, the worker
hand-over of a QC run's report in config/worker_urls.py, a version's page with the runs of
it in apps/runs/page_urls.py). Included from config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.environments import views

urlpatterns = [
    path("t/<slug:team>/environments/", views.environment_list, name="team-environments"),
    path("t/<slug:team>/environments/<slug:environment>/", views.environment_detail,
         name="environment-page"),
]
