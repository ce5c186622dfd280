from django.apps import AppConfig


class TeamsConfig(AppConfig):
    name = "apps.teams"
    label = "teams"

    def ready(self) -> None:
        from apps.teams import token_cache

        token_cache.connect()
