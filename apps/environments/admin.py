from django.contrib import admin

from apps.environments.models import Environment, EnvironmentVersion


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ["slug", "team", "project", "created_at"]
    search_fields = ["slug"]


@admin.register(EnvironmentVersion)
class EnvironmentVersionAdmin(admin.ModelAdmin):
    list_display = ["environment", "number", "digest", "qc_status", "created_at"]
    list_filter = ["qc_status"]
    readonly_fields = ["team", "environment", "number", "digest", "spec", "created_by",
                       "created_at"]
