"""Dashboard page URLs under ``/t/<team>/`` (the runs table and run page are in
``config/urls.py``), with an environment version's page, which launches and lists its
runs."""

from __future__ import annotations

from django.urls import path

from apps.runs import environment_pages, views
from apps.teams import views as team_views

urlpatterns = [
    path("launch/", views.run_launch, name="run-launch"),
    path("compare/", views.run_compare, name="runs-compare"),
    path("runs/<str:run>/samples/", views.run_samples, name="run-page-samples"),
    path("runs/<str:run>/parts/", views.run_parts, name="run-page-parts"),
    path("environments/<slug:environment>/<str:version>/", environment_pages.version_detail,
         name="environment-version-page"),
    path("team/", team_views.team_page, name="team-page"),
    path("audit/", team_views.audit_page, name="team-audit"),
]
