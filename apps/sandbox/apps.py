from django.apps import AppConfig


class SandboxConfig(AppConfig):
    name = "apps.sandbox"
    label = "sandbox"
