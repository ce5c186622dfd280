from django.contrib import admin

from apps.runs.models import Checkpoint, Run, RunEvent, Sample


class ReadOnlyAdmin(admin.ModelAdmin):
    """Runs change state only through services (transitions are audited and published)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ["id", "kind", "status", "team", "project", "pool", "priority", "created_at"]
    list_filter = ["status", "kind", "pool"]
    search_fields = ["id", "name"]


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = ["run", "seq", "level", "kind", "message", "created_at"]
    list_filter = ["level", "kind"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["run", "step", "uri", "created_at"]


@admin.register(Sample)
class SampleAdmin(ReadOnlyAdmin):
    list_display = ["run", "step", "reward", "created_at"]
