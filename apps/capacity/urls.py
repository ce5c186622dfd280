"""The capacity planner's page (its API is routed in config/urls.py). Included from
config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.capacity import views

urlpatterns = [
    path("t/<slug:team>/capacity/", views.planner, name="capacity-page"),
]
