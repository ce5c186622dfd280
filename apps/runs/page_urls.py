"""Dashboard page URLs under ``/t/<team>/`` (the runs table and run page are in
``config/urls.py``)."""

from __future__ import annotations

from django.urls import path

from apps.runs import views
from apps.teams import views as team_views

urlpatterns = [
    path("launch/", views.run_launch, name="run-launch"),
    path("compare/", views.run_compare, name="runs-compare"),
    path("runs/<str:run>/samples/", views.run_samples, name="run-page-samples"),
    path("runs/<str:run>/<str:action>/", views.run_action, name="run-page-action"),
    path("team/", team_views.team_page, name="team-page"),
    path("team/tokens/<str:kind>/", team_views.token_create, name="token-create"),
    path("team/tokens/<str:prefix>/revoke/", team_views.token_revoke, name="token-revoke"),
    path("team/members/", team_views.member_add, name="member-add"),
    path("team/members/<str:username>/", team_views.member_change, name="member-change"),
]
