from django.contrib import admin

from apps.datasets.models import Dataset, DatasetVersion


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["slug", "team", "project", "current_version", "created_at"]
    list_filter = ["team"]
    search_fields = ["slug"]
    raw_id_fields = ["current_version"]


@admin.register(DatasetVersion)
class DatasetVersionAdmin(admin.ModelAdmin):
    list_display = ["dataset", "number", "digest", "record_count", "size_bytes", "created_at"]
    search_fields = ["digest", "dataset__slug"]

    # Versions are immutable: the admin shows them and nothing else.
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
