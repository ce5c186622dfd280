from django.contrib import admin

from apps.projects.models import Project


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["slug", "team", "name", "created_at"]
    list_filter = ["team"]
    search_fields = ["slug", "name"]
