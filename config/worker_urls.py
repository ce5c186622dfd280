"""Every route under ``/api/v1/worker/``, in one place: what the worker pools may call. Each
view is a WorkerViewSet (worker tokens only), and every call that reports output after a
claim or start carries its lease (``X-Crucible-Lease``)."""

from __future__ import annotations

from django.urls import path

from apps.alerts.worker_api import WorkerAlertViewSet
from apps.review.worker_api import WorkerBatchViewSet
from apps.runs.qc_worker_api import WorkerQcViewSet
from apps.runs.worker_api import WorkerRunViewSet, WorkerSweepViewSet
from apps.sandbox.api import WorkerExecutionViewSet
from apps.scheduling.worker_api import WorkerNodeViewSet

run = WorkerRunViewSet.as_view
execution = WorkerExecutionViewSet.as_view
node = WorkerNodeViewSet.as_view

urlpatterns = [
    path("claim", run({"post": "claim"}), name="worker-claim"),
    path("sweep", WorkerSweepViewSet.as_view({"post": "sweep"}), name="worker-sweep"),
    path("metrics/prune", WorkerSweepViewSet.as_view({"post": "prune_metrics"}),
         name="worker-prune-metrics"),
    path("admission", WorkerSweepViewSet.as_view({"post": "admission"}),
         name="worker-admission"),
    path("alerts/evaluate", WorkerAlertViewSet.as_view({"post": "evaluate"}),
         name="worker-alerts-evaluate"),
    path("alerts/deliveries/<str:delivery>/attempt",
         WorkerAlertViewSet.as_view({"post": "attempt"}), name="worker-alerts-attempt"),
    path("runs/<str:run>", run({"get": "retrieve"}), name="worker-run"),
    path("runs/<str:run>/heartbeat", run({"post": "heartbeat"}), name="worker-heartbeat"),
    path("runs/<str:run>/status", run({"post": "status"}), name="worker-status"),
    path("runs/<str:run>/started", run({"post": "started"}), name="worker-started"),
    path("runs/<str:run>/metrics", run({"post": "metrics"}), name="worker-metrics"),
    path("runs/<str:run>/events", run({"post": "events"}), name="worker-events"),
    path("runs/<str:run>/checkpoints", run({"post": "checkpoints"}),
         name="worker-checkpoints"),
    path("runs/<str:run>/samples", run({"post": "samples"}), name="worker-samples"),
    path("runs/<str:run>/artifacts", run({"post": "artifacts"}), name="worker-artifacts"),
    path("runs/<str:run>/qc", WorkerQcViewSet.as_view({"post": "create"}), name="worker-qc"),
    path("runs/<str:run>/batches", WorkerBatchViewSet.as_view({"post": "create"}),
         name="worker-batches"),
    path("executions/<str:execution>/start", execution({"post": "start"}),
         name="worker-execution-start"),
    path("executions/<str:execution>/result", execution({"post": "result"}),
         name="worker-execution-result"),
    path("nodes/register", node({"post": "register"}), name="worker-node-register"),
    path("nodes/<str:name>/heartbeat", node({"post": "heartbeat"}),
         name="worker-node-heartbeat"),
    path("nodes/<str:name>/dead-leases", WorkerSweepViewSet.as_view({"post": "dead_leases"}),
         name="worker-node-dead-leases"),
]
