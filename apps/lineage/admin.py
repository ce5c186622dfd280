from django.contrib import admin

from apps.lineage.models import LineageEdge


@admin.register(LineageEdge)
class LineageEdgeAdmin(admin.ModelAdmin):
    list_display = ["source_type", "source_id", "relation", "target_type", "target_id", "team"]
    list_filter = ["relation", "source_type", "target_type"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
