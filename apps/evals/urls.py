"""The eval suite pages (the API is routed in config/urls.py). Included from config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.evals import views

urlpatterns = [
    path("t/<slug:team>/evals/", views.suite_list, name="evals-page"),
    path("t/<slug:team>/evals/<slug:suite>/", views.leaderboard, name="eval-suite-page"),
]
