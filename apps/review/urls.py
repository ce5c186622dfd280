"""Review routes: the team API (batches, review items), the review queue page and a
dataset's page, which shows the dataset's batches (the worker hand-over of a synthesize
run's batch is in config/worker_urls.py). Included from config/urls.py."""

from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from apps.review import dataset_pages, views
from apps.review.api import BatchViewSet, ReviewItemViewSet

TEAM = r"teams/(?P<team>[-a-zA-Z0-9_]+)"


class _Router(SimpleRouter):
    """Paths work with and without a trailing slash, as in config/urls.py."""

    def __init__(self) -> None:
        super().__init__()
        self.trailing_slash = "/?"


router = _Router()
router.register(rf"{TEAM}/batches", BatchViewSet, basename="batch")
router.register(rf"{TEAM}/review-items", ReviewItemViewSet, basename="review-item")

urlpatterns = [
    path("api/v1/", include(router.urls)),
    path("t/<slug:team>/review/", views.review_queue, name="review-queue"),
    path("t/<slug:team>/datasets/<slug:dataset>/", dataset_pages.dataset_detail,
         name="dataset-page"),
]
