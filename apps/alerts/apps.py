from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "apps.alerts"
    label = "alerts"

    def ready(self) -> None:
        # The apps that store metrics and events sit below this one and cannot call it: they
        # send signals after their commit, and these receivers evaluate the team's rules.
        from apps.alerts import receivers  # noqa: F401
