"""Settings come from the environment only; check --deploy passes with production values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRODUCTION = {
    "DEBUG": "false",
    "SECRET_KEY": "x" * 30 + "-a-long-random-production-secret-key-value",
    "ALLOWED_HOSTS": "crucible.example.com",
    "DATABASE_URL": "postgres://crucible:pw@db.internal:5432/crucible",
    "REDIS_URL": "redis://cache.internal:6379/0",
    "OBJECT_STORE_URL": "s3://crucible-artifacts/prod",
    "SECURE_SSL_REDIRECT": "true",
    "SESSION_COOKIE_SECURE": "true",
    "CSRF_COOKIE_SECURE": "true",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
    "SECURE_HSTS_PRELOAD": "true",
}


def _python(code: str, extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "OBJECT_STORE_URL")}
    env.update({"CRUCIBLE_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings",
                **extra})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


# Only the security checks: drf-spectacular's schema warnings are covered by test_openapi.
DEPLOY_CHECK = ["check", "--deploy", "--tag", "security", "--fail-level", "WARNING"]

SHOW = """
import django, json; django.setup()
from django.conf import settings
from config.celery import app
print(json.dumps({
  "db": settings.DATABASES["default"]["ENGINE"],
  "name": str(settings.DATABASES["default"]["NAME"]),
  "layer": settings.CHANNEL_LAYERS["default"]["BACKEND"],
  "broker": app.conf.broker_url,
  "store": settings.OBJECT_STORE_URL,
}))
"""


def test_embedded_defaults_need_no_variables(tmp_path):
    import json

    result = _python(SHOW, {}, tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["db"] == "django.db.backends.sqlite3"
    assert shown["name"].startswith(str(tmp_path))
    assert shown["layer"] == "channels.layers.InMemoryChannelLayer"
    assert shown["broker"] == "filesystem://"
    assert shown["store"] == (tmp_path / "objects").as_uri()


def test_production_variables_select_postgres_redis_and_s3(tmp_path):
    import json

    result = _python(SHOW, PRODUCTION, tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["db"] == "django.db.backends.postgresql"
    assert shown["layer"] == "channels_redis.core.RedisChannelLayer"
    assert shown["broker"] == "redis://cache.internal:6379/0"
    assert shown["store"] == "s3://crucible-artifacts/prod"


def test_check_deploy_passes_with_production_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(PRODUCTION)
    env["CRUCIBLE_VAR_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "manage.py", *DEPLOY_CHECK],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_deploy_flags_the_embedded_secret_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update({**PRODUCTION, "CRUCIBLE_VAR_DIR": str(tmp_path)})
    env.pop("SECRET_KEY")
    result = subprocess.run(
        [sys.executable, "manage.py", *DEPLOY_CHECK],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stdout + result.stderr


RATES = """
import django, json; django.setup()
from django.conf import settings
print(json.dumps([settings.CRUCIBLE["COST_PER_GPU_HOUR"], settings.CRUCIBLE["COST_CURRENCY"]]))
"""


def test_cost_rates_come_from_the_environment_and_bad_ones_stop_the_start(tmp_path):
    import json

    result = _python(RATES, {"CRUCIBLE_COST_PER_GPU_HOUR": '{"H100": 2.5, "cpu": 0.05}',
                             "CRUCIBLE_COST_CURRENCY": "EUR"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [
        {"H100": 2.5, "cpu": 0.05}, "EUR"]
    assert json.loads(_python(RATES, {}, tmp_path).stdout.strip().splitlines()[-1]) == [
        {}, "USD"]
    for bad, words in (('{"H100": "cheap"}', "the rate of 'H100' must be a non-negative"),
                       ("{H100: 2}", "CRUCIBLE_COST_PER_GPU_HOUR"),
                       ("[2.5]", "must be a JSON object")):
        result = _python(RATES, {"CRUCIBLE_COST_PER_GPU_HOUR": bad}, tmp_path)
        assert result.returncode != 0 and "ImproperlyConfigured" in result.stderr, bad
        assert words in result.stderr, (bad, result.stderr[-500:])


def test_amqp_brokers_publish_with_confirms_and_redis_needs_no_options(tmp_path):
    """A publish to RabbitMQ returns only once the broker routed it: without confirms a task
    sent just before the broker drops is lost silently (and a queue count taken right after
    a publish missed messages in CI)."""
    from config import env

    for url in ("amqp://guest:guest@127.0.0.1:5672//", "pyamqp://rabbit:5672//"):
        assert env.broker_transport_options(url) == {"confirm_publish": True}
    assert env.broker_transport_options("redis://127.0.0.1:6379/0") == {}
