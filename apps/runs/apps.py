from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "apps.runs"
    label = "runs"

    def ready(self) -> None:
        # Registers the admission pass that commits of queued runs trigger (dispatch.py).
        from apps.runs import admission  # noqa: F401
