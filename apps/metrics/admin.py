from django.contrib import admin

from apps.metrics.models import MetricBatch


@admin.register(MetricBatch)
class MetricBatchAdmin(admin.ModelAdmin):
    list_display = ["run", "seq", "point_count", "received_at"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
