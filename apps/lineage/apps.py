from django.apps import AppConfig


class LineageConfig(AppConfig):
    name = "apps.lineage"
    label = "lineage"
