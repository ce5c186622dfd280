"""Django settings, from environment variables only (django-environ).

With no variables set, Crucible runs on its embedded defaults: SQLite under ``var/``, a
filesystem Celery transport, the in-memory channel layer and an object store in
``var/objects``. Production sets ``DATABASE_URL``, ``REDIS_URL`` and ``OBJECT_STORE_URL``
(plus ``S3_ENDPOINT_URL`` and credentials for an S3-compatible store).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from apps.usage.accounting import parse_rates
from config import env as crucible_env

BASE_DIR = crucible_env.BASE_DIR
VAR_DIR = crucible_env.var_dir()

env = environ.Env()

DEBUG = env.bool("DEBUG", default=False)
# The embedded default is a developer's machine: a fixed, clearly-marked key is fine there;
# production must set SECRET_KEY (check --deploy fails on this one).
SECRET_KEY = env.str("SECRET_KEY", default="django-insecure-crucible-embedded-default-key")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "channels",
    "axes",
    "apps.core",
    "apps.teams",
    "apps.projects",
    "apps.datasets",
    "apps.environments",
    "apps.runs",
    "apps.metrics",
    "apps.lineage",
    "apps.sandbox",
    "apps.scheduling",
    "apps.review",
    "apps.capacity",
    "apps.usage",
    "apps.alerts",
    "apps.evals",
    "apps.filtering",
]

MIDDLEWARE = [
    # First, so the latency histogram (crucible_http_request_duration_seconds) sees the whole
    # request, static files and refusals included.
    "apps.core.telemetry.request_metrics",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    # Last, as django-axes requires: it turns a locked-out login into its lockout response.
    "axes.middleware.AxesMiddleware",
]

# django-axes first: it refuses a login attempt while its username+address is locked out.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

# Content-Security-Policy (django-csp: Django 5.2 has no built-in CSP; 6.0 adds one). Scripts
# and styles come from this origin only — no inline <script>, no on* handlers, no <style>
# blocks or style attributes, no eval (templates pass data as json_script and bind
# behaviour from static/js/). 'self' in connect-src covers the same-origin websockets.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:", "blob:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'crucible.sqlite3'}"),
}
DATABASES["default"]["ATOMIC_REQUESTS"] = False
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the web process read while a writer holds the lock; the busy timeout
    # turns brief lock contention into a wait instead of "database is locked". IMMEDIATE
    # transactions take the write lock at BEGIN, where the busy timeout applies; a deferred
    # transaction that reads and then writes fails at once if another writer got in between.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE",
         "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}
    )
    # Tests use a file too, not the in-memory default: shared-cache in-memory SQLite locks
    # whole tables and fails at once ("database table is locked") when the live server's
    # threads read and write together, where a WAL file simply waits.
    # One file per test process, so concurrent pytest runs never share one.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
elif env.int("DATABASE_POOL_SIZE", default=0) > 0:
    # A bounded psycopg pool per process. Under ASGI each request runs in a thread context of
    # its own, so persistent connections (CONN_MAX_AGE) are not reused but left open until
    # garbage collection: 16 metric writers over 2 web processes held 60-80 connections and
    # ran PostgreSQL out of them ("too many clients"; bench_ingest's concurrent section). A
    # pool caps them at DATABASE_POOL_SIZE a process (a request waits up to 30 s for one)
    # and skips the connection set-up per request. Django requires CONN_MAX_AGE 0 with it.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1, "max_size": env.int("DATABASE_POOL_SIZE"), "timeout": 30}
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=60)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = env.str("STATIC_ROOT", default=str(VAR_DIR / "staticfiles"))
Path(STATIC_ROOT).mkdir(parents=True, exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from the app folders in the embedded default (no collectstatic step).
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

APPEND_SLASH = False

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# --- Redis: Celery broker and channel layer in production; absent in the embedded default.
REDIS_URL = crucible_env.redis_url()
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# The cache holds the API's rate-limit counters: shared through Redis by every web process
# in production; in-process in the embedded default (one web process).
if REDIS_URL:
    # One Redis client per process, not one per request: see apps/core/cache.py.
    CACHES = {"default": {"BACKEND": "apps.core.cache.SharedRedisCache",
                          "LOCATION": REDIS_URL, "KEY_PREFIX": "crucible"}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Object store (dataset records, checkpoints, reports).
OBJECT_STORE_URL = crucible_env.object_store_url()

# --- Crucible behaviour.
CRUCIBLE = {
    # How long a claim lasts without a heartbeat before the sweep requeues the run.
    "LEASE_SECONDS": env.int("CRUCIBLE_LEASE_SECONDS", default=120),
    # Attempts a run gets (lost leases and retryable failures) before it fails for good;
    # a launch may ask for 1-20.
    "MAX_ATTEMPTS": env.int("CRUCIBLE_MAX_ATTEMPTS", default=3),
    # How long an opened review item stays locked to its reviewer.
    "REVIEW_LOCK_SECONDS": env.int("CRUCIBLE_REVIEW_LOCK_SECONDS", default=600),
    "MAX_METRIC_BATCH": env.int("CRUCIBLE_MAX_METRIC_BATCH", default=10_000),
    "MAX_EVENT_BATCH": env.int("CRUCIBLE_MAX_EVENT_BATCH", default=1_000),
    "MAX_SAMPLE_BATCH": env.int("CRUCIBLE_MAX_SAMPLE_BATCH", default=1_000),
    "MAX_DOWNSAMPLE_POINTS": env.int("CRUCIBLE_MAX_DOWNSAMPLE_POINTS", default=5_000),
    "MAX_UPLOAD_RECORDS": env.int("CRUCIBLE_MAX_UPLOAD_RECORDS", default=1_000_000),
    # Canonical JSONL bytes of one upload: a compressed Parquet file can expand a thousandfold.
    "MAX_UPLOAD_BYTES": env.int("CRUCIBLE_MAX_UPLOAD_BYTES", default=4 * 1024**3),
    # Sandbox executions a team may have queued or running at once, and per batch request.
    "SANDBOX_QUOTA": env.int("CRUCIBLE_SANDBOX_QUOTA", default=256),
    "SANDBOX_MAX_BATCH": env.int("CRUCIBLE_SANDBOX_MAX_BATCH", default=256),
    # Sandbox sessions: the session host that keeps them (workers/sandbox/session_host.py),
    # its shared secret, and how many open sessions a team may hold.
    "SESSION_HOST_URL": env.str("CRUCIBLE_SESSION_HOST_URL", default="http://127.0.0.1:8765"),
    "SESSION_HOST_TOKEN": env.str("CRUCIBLE_SESSION_HOST_TOKEN", default=""),
    "SESSION_QUOTA": env.int("CRUCIBLE_SESSION_QUOTA", default=64),
    # Where workers reach the API (embedded default: the web process on this host).
    "PUBLIC_URL": env.str("CRUCIBLE_PUBLIC_URL", default="http://127.0.0.1:8000"),
    # Threads a web process runs HTTP requests on (apps/core/asgi_http.py): its most
    # concurrent requests, and without DATABASE_POOL_SIZE its most database connections.
    # 0: Django's own async handler (a thread hop per middleware; kept for comparison).
    "HTTP_THREADS": env.int("CRUCIBLE_HTTP_THREADS", default=16),
    # Verified API tokens kept per web process (apps/teams/token_cache.py; only with Redis):
    # a revocation applies on the next request everywhere; a change made without the ORM's
    # save/delete within this many seconds. 0: every request queries the database.
    "TOKEN_CACHE_S": env.int("CRUCIBLE_TOKEN_CACHE_S", default=30),
    # What runs may make workers reach (workers/egress.py; workers read the same variables):
    # hosts and CIDRs for endpoint base_urls, absolute roots for "path:" model directories.
    "ENDPOINT_ALLOW": env.str("CRUCIBLE_ENDPOINT_ALLOW",
                              default="127.0.0.0/8,::1/128,localhost"),
    "MODEL_PATH_ROOTS": env.str("CRUCIBLE_MODEL_PATH_ROOTS", default=""),
    # Teams one person may create (operators' commands and superusers are not limited).
    "TEAMS_PER_USER": env.int("CRUCIBLE_TEAMS_PER_USER", default=20),
    # Deepest JSON nesting a request body, upload line or websocket frame may have.
    "MAX_JSON_DEPTH": env.int("CRUCIBLE_MAX_JSON_DEPTH", default=64),
    # API rate limits (DRF throttles, apps/core/throttles.py): "<count>/<sec|min|hour|day>".
    "THROTTLE_RATES": {
        "user": env.str("CRUCIBLE_THROTTLE_USER", default="1200/min"),
        "worker": env.str("CRUCIBLE_THROTTLE_WORKER", default="12000/min"),
        "anon": env.str("CRUCIBLE_THROTTLE_ANON", default="120/min"),
        "auth_failure": env.str("CRUCIBLE_THROTTLE_AUTH_FAILURE", default="20/min"),
    },
    # Proxies in front of the web processes that append to X-Forwarded-For (0: trust none,
    # the client address is REMOTE_ADDR). Rate limits and login lockouts key on it.
    "TRUSTED_PROXIES": env.int("CRUCIBLE_TRUSTED_PROXIES", default=0),
    # Node inventory (apps/scheduling): a node whose agent has not heartbeat for this long
    # goes `lost` at the next sweep; this many infrastructure failures in a row cordon it.
    "NODE_LOST_AFTER_S": env.int("CRUCIBLE_NODE_LOST_AFTER_S", default=30),
    "NODE_INFRA_FAILURES_TO_CORDON": env.int("CRUCIBLE_NODE_INFRA_FAILURES_TO_CORDON",
                                             default=3),
    # The admission loop (apps/runs/admission.py, docs/scheduling.md): off, a launch sends
    # its run to the pool's queue at once (first come, first served); on, a run waits for an
    # allocation (nodes, GPU ids, its team's quota) and only then is it sent and claimable.
    "SCHEDULER": env.bool("CRUCIBLE_SCHEDULER", default=False),
    # How long a preempted run has to checkpoint and stop before its lease is revoked.
    "PREEMPT_GRACE_S": env.int("CRUCIBLE_PREEMPT_GRACE_S", default=300),
    # A bearer token that may read /metrics (a Prometheus scrape config's credentials);
    # blank: only staff users and operator worker tokens may (docs/operations.md).
    "METRICS_TOKEN": env.str("CRUCIBLE_METRICS_TOKEN", default=""),
    # The preemption policy's knobs (workers.scheduling.decide.Policy): a run is preempted
    # only once it ran this long in its current attempt, fewer than this many times, and
    # while it would lose at most this much work (seconds since its last checkpoint).
    "PREEMPT_MIN_RUNTIME_S": env.float("CRUCIBLE_PREEMPT_MIN_RUNTIME_S", default=600.0),
    "MAX_PREEMPTIONS": env.int("CRUCIBLE_MAX_PREEMPTIONS", default=3),
    "PREEMPT_MAX_LOSS_S": env.float("CRUCIBLE_PREEMPT_MAX_LOSS_S", default=900.0),
    # What usage costs (apps/usage, docs/usage.md): hourly rates per GPU type ("gpu": any type
    # not listed; "cpu": per core-hour of CPU-only work), in COST_CURRENCY. A GPU type with
    # no rate is shown unpriced, never as free.
    "COST_PER_GPU_HOUR": {},
    "COST_CURRENCY": env.str("CRUCIBLE_COST_CURRENCY", default="USD"),
    # Alert webhooks (apps/alerts, docs/alerts.md). URLs are tenant input: private, loopback
    # and link-local addresses are refused unless this allows them (a test's local receiver,
    # or an on-premises receiver on a private network).
    "WEBHOOK_ALLOW_PRIVATE": env.bool("CRUCIBLE_WEBHOOK_ALLOW_PRIVATE", default=False),
    # Attempts per delivery, the first retry's delay (doubling up to the cap), the timeout.
    "WEBHOOK_MAX_ATTEMPTS": env.int("CRUCIBLE_WEBHOOK_MAX_ATTEMPTS", default=6),
    "WEBHOOK_BACKOFF_S": env.float("CRUCIBLE_WEBHOOK_BACKOFF_S", default=10.0),
    "WEBHOOK_BACKOFF_CAP_S": env.float("CRUCIBLE_WEBHOOK_BACKOFF_CAP_S", default=900.0),
    "WEBHOOK_TIMEOUT_S": env.float("CRUCIBLE_WEBHOOK_TIMEOUT_S", default=5.0),
}
try:
    CRUCIBLE["COST_PER_GPU_HOUR"] = parse_rates(env.json("CRUCIBLE_COST_PER_GPU_HOUR", default={}))
except ValueError as exc:  # a JSON syntax error is a ValueError too
    raise ImproperlyConfigured(f"CRUCIBLE_COST_PER_GPU_HOUR: {exc}") from exc

# --- Password logins (django-axes): a username+address pair is locked out after
# CRUCIBLE_LOGIN_FAILURE_LIMIT failures for CRUCIBLE_LOGIN_LOCKOUT_MINUTES (the right
# password included), answered 429 with Retry-After. Attempts are kept in the database.
AXES_FAILURE_LIMIT = env.int("CRUCIBLE_LOGIN_FAILURE_LIMIT", default=10)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("CRUCIBLE_LOGIN_LOCKOUT_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "apps.core.throttles.axes_client_ip"
AXES_LOCKOUT_CALLABLE = "apps.teams.lockout.lockout_response"
AXES_VERBOSE = False
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE", default=64 * 1024 * 1024)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.teams.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["apps.core.permissions.AuthenticatedOrThrottled"],
    "DEFAULT_PAGINATION_CLASS": "apps.core.pagination.CursorPagination",
    "DEFAULT_METADATA_CLASS": "apps.core.metadata.BodyWhereKnownMetadata",
    "DEFAULT_PARSER_CLASSES": [
        "apps.core.parsers.FastJSONParser",
        "apps.core.parsers.MsgpackParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "apps.core.errors.exception_handler",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_THROTTLE_CLASSES": [
        "apps.core.throttles.TokenRateThrottle",
        "apps.core.throttles.WorkerRateThrottle",
        "apps.core.throttles.AnonIPRateThrottle",
    ],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Crucible API",
    "DESCRIPTION": "Datasets, environments and RL runs for teams; worker endpoints for pools.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.core.schema.add_error_responses",
        "apps.core.schema.protocol_schemas",
    ],
    # Run.kind and ApiToken.kind are both "kind": name their enums instead of "Kind70eEnum".
    "ENUM_NAME_OVERRIDES": {
        "RunKindEnum": "apps.runs.models.RunKind",
        "AlertRuleKindEnum": "apps.alerts.models.RuleKind",
        "DeliveryStatusEnum": "apps.alerts.models.DeliveryStatus",
        "RunStatusEnum": "apps.runs.models.RunStatus",
        "TokenKindEnum": "apps.teams.models.TokenKind",
        "PoolEnum": "apps.runs.models.Pool",
        # workers.protocol.PoolName (a Literal: values without labels) in worker documents.
        "PoolNameEnum": ["gpu", "sandbox", "cpu"],
        "NodeStateEnum": "apps.scheduling.models.NodeState",
        "FilterSurfaceNameEnum": "apps.filtering.models.Surface",
        "FilterModeEnum": "apps.filtering.models.MODE_CHOICES",
        "VariantKindEnum": "apps.evals.models.VariantKind",
    },
}

# --- Production hardening.
# Trust a forwarded-protocol header only when the operator says a proxy in front of every
# web process sets it (and strips it from clients): otherwise any client could claim HTTPS.
# SECURE_PROXY_SSL_HEADER=X-Forwarded-Proto means "the proxy sends X-Forwarded-Proto: https".
_proxy_header = env.str("SECURE_PROXY_SSL_HEADER", default="").strip()
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _proxy_header.upper().replace("-", "_"), "https") if _proxy_header else None
)
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=False)
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=False)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=False)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.server": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}
