from __future__ import annotations

from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "apps.evals"
    label = "evals"
    verbose_name = "Eval suites"

    def ready(self) -> None:
        # Runs cannot import this app (it sits above them): it hooks into their writes here.
        from apps.evals import services
        from apps.runs import hooks

        # ready() may run twice in some test set-ups: register each hook once.
        if services.on_checkpoint_added not in hooks.CHECKPOINT_ADDED:
            hooks.CHECKPOINT_ADDED.append(services.on_checkpoint_added)
        if services.on_run_finished not in hooks.RUN_FINISHED:
            hooks.RUN_FINISHED.append(services.on_run_finished)
        if services.check_train_launch not in hooks.LAUNCH_CHECKS:
            hooks.LAUNCH_CHECKS.append(services.check_train_launch)
