from django.contrib import admin

from apps.scheduling.models import Allocation, Node, NodeTransition, Queue


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Read-only: state changes go through the services (history and audit), from the
    cluster page or the API."""

    list_display = ["name", "pool", "gpu_type", "gpu_count", "state", "state_reason",
                    "last_heartbeat_at"]
    list_filter = ["state", "pool", "gpu_type"]
    search_fields = ["name"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(NodeTransition)
class NodeTransitionAdmin(admin.ModelAdmin):
    list_display = ["node", "from_state", "to_state", "reason", "actor", "at"]
    list_filter = ["to_state"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    """Read-only: a queue is set through ``set_queue`` (validated, audited), from the API."""

    list_display = ["team", "cohort", "nominal", "default_priority", "updated_at"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    """Read-only: the admission pass writes allocations and the runs' transitions release
    them."""

    list_display = ["run", "node", "gpu_ids", "flavor", "created_at", "dispatched_at",
                    "released_at"]
    list_filter = ["flavor"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
