from django.apps import AppConfig


class FilteringConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.filtering"
    label = "filtering"
