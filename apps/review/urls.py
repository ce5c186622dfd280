"""Review routes: the team API (batches, review items), the worker hand-over of a
synthesize run's batch, and the review queue page. Included from config/urls.py."""

from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from apps.review import views
from apps.review.api import BatchViewSet, ReviewItemViewSet
from apps.review.worker_api import WorkerBatchViewSet

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
    path("api/v1/worker/runs/<str:run>/batches",
         WorkerBatchViewSet.as_view({"post": "create"}), name="worker-batches"),
    path("t/<slug:team>/review/", views.review_queue, name="review-queue"),
]
