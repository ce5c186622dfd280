"""The alerts page (its API is routed in config/urls.py). Included from config/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.alerts import views

urlpatterns = [
    path("t/<slug:team>/alerts/", views.alerts_page, name="alerts-page"),
]
