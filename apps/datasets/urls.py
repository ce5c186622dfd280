"""Dataset dashboard pages (the dataset API is routed in config/urls.py)."""

from __future__ import annotations

from django.urls import path

from apps.datasets import views

urlpatterns = [
    path("t/<slug:team>/datasets/", views.dataset_list, name="team-datasets"),
    path("t/<slug:team>/datasets/<slug:dataset>/diff/", views.dataset_diff,
         name="dataset-diff-page"),
    path("t/<slug:team>/datasets/<slug:dataset>/records/", views.dataset_records,
         name="dataset-records-page"),
    path("t/<slug:team>/datasets/<slug:dataset>/upload/", views.dataset_upload,
         name="dataset-upload-page"),
    path("t/<slug:team>/datasets/<slug:dataset>/rollback/", views.dataset_rollback,
         name="dataset-rollback-page"),
]
