from django.contrib import admin

from apps.sandbox.models import Execution


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    list_display = ["id", "team", "language", "status", "worker", "created_at", "finished_at"]
    list_filter = ["status", "language"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
