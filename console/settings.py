"""Settings for the operator console. Everything environment-specific comes from env.py."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
from datetime import timedelta
from typing import Any

import dj_database_url
from csp.constants import NONE, SELF

from console.env import (
    BASE_DIR,
    VAR_DIR,
    ConfigError,
    env_flag,
    local_web_port,
    read_config,
    url_parts,
    url_shown,
)
from operations.providers.base import sandbox_endpoint
from operations.providers.payments import PAYMENT_METHOD_ID, STRIPE_SECRET, STRIPE_VERSION

CONFIG = read_config(os.environ)


# The largest value of each kind of number. Generous for any deployment, and small enough
# that `now() + timedelta(...)` (the engine's leases and re-checks, the lockout's end) can
# never overflow, which would fail every operation long after a start that looked fine.
MAX_SECONDS = 10 * 365 * 24 * 3600  # ten years
MAX_COUNT = 1_000_000_000
MAX_AMOUNT_MINOR = 10**18  # under the bigint every amount is stored in


def _number_env(
    name: str, default: str, kind: type[int] | type[float], *, positive: bool,
    maximum: int,
) -> Any:
    # Same rule as env.py: a bad value stops the start with one line naming the variable.
    # Every number here is a duration, a count or a limit: none may be negative (nor nan or
    # inf), and one that paces or bounds something may not be 0 (a beat of 0 s sends its
    # sweep hundreds of times a second).
    raw = os.environ.get(name, default)
    what = "a whole number" if kind is int else "a number"
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "above 0" if positive else "0 or more"
        raise ConfigError(f"{name}={raw!r} must be {what} {bound}")
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} must be at most {maximum}")
    return value


def _float_env(
    name: str, default: str, *, positive: bool = True, maximum: int = MAX_SECONDS
) -> float:
    return _number_env(name, default, float, positive=positive, maximum=maximum)


def _int_env(
    name: str, default: str, *, positive: bool = True, maximum: int = MAX_SECONDS
) -> int:
    return _number_env(name, default, int, positive=positive, maximum=maximum)


def _log_level_env(name: str, default: str) -> str:
    # logging.config takes only upper-case names and answers anything else with a
    # traceback from deep inside django.setup(), after the settings loaded fine.
    raw = os.environ.get(name, default)
    level = raw.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ConfigError(
            f"{name}={raw!r} is not a logging level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return level


def _flag_env(name: str, default: bool) -> bool:
    # 1/0, true/false, yes/no, on/off; anything else stops the start (never "silently off").
    return env_flag(os.environ, name, default)


DEBUG = CONFIG.debug
SECRET_KEY = CONFIG.secret_key
SECRET_KEY_FALLBACKS = CONFIG.secret_key_fallbacks
ALLOWED_HOSTS = CONFIG.allowed_hosts
CSRF_TRUSTED_ORIGINS = CONFIG.csrf_trusted_origins

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_htmx",
    "template_partials",
    "guardian",
    "csp",
    "axes",
    "operations",
    "operations.sandbox",
    "approvals",
    "replays",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Every page needs a signed-in user unless its view is marked login_not_required.
    "console.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    # Last, as django-axes asks: it turns a refused sign-in into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"

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
                "console.context_processors.shell",
            ],
        },
    },
]

DATABASES = {"default": dj_database_url.parse(CONFIG.database_url, conn_max_age=60)}
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("OPTIONS", {})
# A statement stuck on a lock must fail loudly rather than hang a worker forever.
DATABASES["default"]["OPTIONS"].setdefault("options", "-c lock_timeout=10000")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    # First: a locked-out sign-in is refused before any password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
GUARDIAN_RAISE_403 = False
ANONYMOUS_USER_NAME = None  # guardian: no anonymous user row, anonymous sees nothing

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

# Guessing passwords: after LOGIN_FAILURE_LIMIT wrong ones for one username from one address,
# that pair is refused for LOGIN_LOCKOUT_MINUTES, however right the next password (django-axes;
# a success before the limit starts the count again); an admin lifts one with
# `manage.py axes_reset_username`. The address is the connection's unless FORWARDING_PROXIES
# says how many front servers (nginx alone: 1) add to X-Forwarded-For on the way in. Without
# it, behind a front server every sign-in came from its address: anyone's five wrong
# guesses paused an approver everywhere.
FORWARDING_PROXIES = _int_env("FORWARDING_PROXIES", "0", positive=False, maximum=MAX_COUNT)
AXES_CLIENT_IP_CALLABLE = "console.sign_in.sign_in_address"
AXES_FAILURE_LIMIT = _int_env("LOGIN_FAILURE_LIMIT", "5", maximum=MAX_COUNT)
AXES_COOLOFF_TIME = timedelta(
    minutes=_int_env("LOGIN_LOCKOUT_MINUTES", "15", maximum=MAX_SECONDS // 60)
)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# A try during the pause is refused without being counted: django-axes' default restarts the
# pause at each one, so a person who "waits and tries again" (the lockout page) a little
# early would be kept out for another full pause, again and again.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
# Failures only: every success in a table of its own would grow without end, unread.
AXES_DISABLE_ACCESS_LOG = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}

# Security: `manage.py check --deploy` passes with DEBUG off.
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
# Signing in again (in this tab or another) renews the token: a page loaded before then is
# refused. Said in words, with the way back, never Django's "CSRF verification failed".
CSRF_FAILURE_VIEW = "console.views.csrf_failure"
SECURE_SSL_REDIRECT = _flag_env("SECURE_SSL_REDIRECT", True) and not DEBUG
# Load balancers and orchestrators probe health over plain http.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
# Read whatever DEBUG, like every other value: a typo must stop a development or staging
# start too, not first the production one.
SECURE_HSTS_SECONDS = _int_env("SECURE_HSTS_SECONDS", "31536000", positive=False)
if DEBUG:
    SECURE_HSTS_SECONDS = 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = False
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
if _flag_env("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
if not DEBUG:
    SILENCED_SYSTEM_CHECKS = [
        # HSTS preload is a per-domain decision that the deployer makes, not the app.
        "security.W021",
    ]

# No inline scripts or styles anywhere: every script is a file under static/.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],
        "connect-src": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
        "base-uri": [SELF],
        "object-src": [NONE],
    },
}

# Celery: broker and result store are the same Redis.
CELERY_BROKER_URL = CONFIG.redis_url
CELERY_RESULT_BACKEND = CONFIG.redis_url
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Blank is unset, as for every name here: a queue named "" is one no worker consumes, and
# every execute, reconcile and sweep would wait there unseen while /healthz said ok.
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "").strip() or "console"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # acks_late tasks that a dead worker held come back after this many seconds, at the
    # next restore sweep: kombu sweeps every interval times throttle seconds (100 s by its
    # defaults, 10 s here). The engine's own sweep recovers the operation sooner anyway
    # (expired leases); the redelivery only finds nothing left to do.
    "visibility_timeout": _int_env("CELERY_VISIBILITY_TIMEOUT", "300"),
    "unacked_restore_interval": _int_env("CELERY_UNACKED_RESTORE_SECONDS", "10"),
    "unacked_restore_throttle": 1,
    # A Redis that keeps the connection open and never answers (a failover's pause, a peer
    # gone behind a NAT) blocked a publish for good: the approver's request after its
    # commit, beat's sweep, /healthz. Now a publish gives up, is logged, and the sweep
    # queues the work again. Well above BRPOP's 1 s poll, which must not time out.
    "socket_timeout": 5,
    "socket_connect_timeout": 5,
    "socket_keepalive": True,
}
# The same for the result store (worker_ping waits on it; the operations' tasks store none).
CELERY_REDIS_SOCKET_TIMEOUT = 5
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = 5
# Celery's Django fixup closes every database connection before and after each task unless
# this is set, so each execute paid a new PostgreSQL connection (backend start, auth, session
# setup). With it, Celery only force-closes every this-many tasks, and the task_prerun /
# task_postrun handlers in console/celery.py apply Django's own per-request rule in between
# (close_old_connections: CONN_MAX_AGE, CONN_HEALTH_CHECKS, never reuse one left in a
# transaction or after an error), the same rule the web processes follow.
CELERY_DB_REUSE_MAX = _int_env(
    "CELERY_DB_REUSE_MAX", "1000", positive=False, maximum=MAX_COUNT)
CELERY_BEAT_SCHEDULE_FILENAME = os.environ.get(
    "CELERY_BEAT_SCHEDULE_FILENAME", str(VAR_DIR / "celerybeat-schedule")
)


def _beat_entry(task: str, every: float) -> dict:
    # Each run does all that is due, so one still queued after five minutes is dropped: a
    # worker outage would otherwise leave a backlog (720 sweeps an hour) for the returning
    # worker to drain. Not sooner: under a queue a few minutes deep, dropping every run would
    # leave expired leases unswept until it drained.
    return {"task": task, "schedule": every, "options": {"expires": max(every, 300.0)}}


CELERY_BEAT_SCHEDULE: dict[str, dict] = {
    "sweep-operations": _beat_entry(
        "operations.sweep_operations", _float_env("OPERATION_SWEEP_SECONDS", "5")
    ),
    "expire-approvals": _beat_entry("approvals.expire_overdue", 30.0),
}

# The engine's timing. A lease must outlast the provider timeout, or a slow answer would be
# taken for a dead worker.
OPERATION_LEASE_SECONDS = _int_env("OPERATION_LEASE_SECONDS", "30")
RECONCILE_DELAY_SECONDS = _int_env("RECONCILE_DELAY_SECONDS", "5", positive=False)
ACCEPTED_RECONCILE_SECONDS = _int_env("ACCEPTED_RECONCILE_SECONDS", "120")
# An accepted effect whose lookups have all failed this long (a wrong API base or key after
# a deploy, a provider outage) is listed in the operators' queue; the lookups go on.
ACCEPTED_LOOKUP_FAILING_SECONDS = _int_env("ACCEPTED_LOOKUP_FAILING_SECONDS", "3600")
# An approved operation no worker has claimed after this long is queued again.
EXECUTE_RECHECK_SECONDS = _int_env("EXECUTE_RECHECK_SECONDS", "60")
# Then again after as long as it has waited so far (a backoff), at most this far apart.
EXECUTE_RECHECK_MAX_SECONDS = _int_env("EXECUTE_RECHECK_MAX_SECONDS", "900")
# Calls the engine makes on its own for one operation (each after a lookup proved the last
# one left nothing); past that, a person decides.
OPERATION_MAX_AUTOMATIC_CALLS = _int_env(
    "OPERATION_MAX_AUTOMATIC_CALLS", "5", maximum=MAX_COUNT)
POLICY_VERSION_OVERRIDES: dict[str, str] = {}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": _log_level_env("LOG_LEVEL", "INFO")},
    "filters": {"client_errors": {"()": "console.logs.ClientErrorsWithoutTraceback"}},
    "loggers": {
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        # Its banner at every process start would be a second line on every command's
        # stderr; its warnings (a failed sign-in, a lockout) still come through.
        "axes.apps": {"level": "WARNING"},
        # Django's own handler for its loggers prints with DEBUG on, and the record then
        # reaches the root's handler too: every line twice under `make run`.
        "django": {"handlers": [], "propagate": True},
        "django.request": {"filters": ["client_errors"]},
    },
}

# Demo data (tenants acme/globex and their users) is only ever created with DEBUG on.
DEMO_PASSWORD = os.environ.get("DEMO_PASSWORD", "")



# Providers. The defaults point at the project's own sandbox providers so that a fresh checkout
# demos end to end; a real deployment sets *_API_BASE to a Stripe-compatible endpoint etc.
# A /sandbox/ base with DEBUG off is allowed on purpose: that is a demo deployment.
_SANDBOX_BASE = f"http://127.0.0.1:{local_web_port(os.environ)}/sandbox"


def _provider_credential(name: str, sandbox_value: str, *, base: str) -> str:
    """An API key or webhook secret. Its default is the sandbox's, printed in this file, so
    it serves only the sandbox: with DEBUG off and the provider's base elsewhere, anyone
    could sign webhooks with it. Then the variable must be set."""
    value = os.environ.get(name, "")
    if value:
        if value != value.strip() or not value.isprintable():
            # A secret file's trailing newline, a stray space: no header can carry it (httpx
            # refuses every request, a transport error, so every effect of that provider
            # would end unknown) and no signature made with the provider's secret matches.
            # The line repeats nothing of it: it reaches logs and terminals.
            raise ConfigError(
                f"{name} has a blank at its start or end, or a line break or other control "
                "character; remove it (a secret file's trailing newline?)"
            )
        return value
    if not DEBUG and not sandbox_endpoint(base):
        raise ConfigError(
            f"{name} must be set: its provider is not the sandbox ({url_shown(base)})")
    if not DEBUG:
        # A demo deployment serves its sandbox to the world: with the printed value anyone
        # could call it, read every tenant's effects there, and sign webhooks the console
        # applies. Its own value, from SECRET_KEY, is known to its processes alone (the web
        # process, the worker and beat derive the same one).
        digest = hmac.new(SECRET_KEY.encode(), f"sandbox:{name}".encode(), hashlib.sha256)
        return f"{sandbox_value}_{digest.hexdigest()}"
    return sandbox_value


def _api_base_env(name: str, default: str) -> str:
    # httpx refuses a base with no http(s) scheme or no host only at the first call, and
    # the transport reports that as a connection error: every effect of that provider would
    # end unknown, long after a start that looked fine. (Only the scheme is ever shown: a
    # base may carry credentials.)
    raw = os.environ.get(name, default)
    parts = url_parts(name, raw.strip())
    if parts.scheme not in {"http", "https"}:
        raise ConfigError(
            f"{name} must be an http(s) URL (https://api.example.com), "
            f"got scheme {parts.scheme!r}"
        )
    if not parts.hostname:
        raise ConfigError(f"{name} names no host (https://HOST/...)")
    return raw


PAYMENTS_API_BASE = _api_base_env("PAYMENTS_API_BASE", f"{_SANDBOX_BASE}/payments")
PAYMENTS_API_KEY = _provider_credential(
    "PAYMENTS_API_KEY", "sk_test_sandbox", base=PAYMENTS_API_BASE)
PAYMENTS_WEBHOOK_SECRET = _provider_credential(
    "PAYMENTS_WEBHOOK_SECRET", "whsec_sandbox_payments", base=PAYMENTS_API_BASE)
# The saved PaymentMethod the console's account pays with: Stripe refuses a confirm=true
# create that names none. Required with DEBUG off for a real provider, as its key is: the
# default, "pm_card_visa", is one of Stripe's test-mode ids, which the sandbox takes too and
# a live account does not have.
PAYMENTS_PAYMENT_METHOD = os.environ.get("PAYMENTS_PAYMENT_METHOD", "")
if not PAYMENTS_PAYMENT_METHOD:
    if not DEBUG and not sandbox_endpoint(PAYMENTS_API_BASE):
        raise ConfigError("PAYMENTS_PAYMENT_METHOD must be set: its provider is not the "
                          f"sandbox ({url_shown(PAYMENTS_API_BASE)})")
    PAYMENTS_PAYMENT_METHOD = "pm_card_visa"
elif not PAYMENT_METHOD_ID.fullmatch(PAYMENTS_PAYMENT_METHOD):
    # Taken as it is, the provider would refuse every payment only after a person approved
    # it; and an API key pasted here would go out as a request parameter. The line repeats
    # no secret: it reaches logs and terminals.
    _shown = ("a value that looks like a secret key" if STRIPE_SECRET.search(
        PAYMENTS_PAYMENT_METHOD) else repr(PAYMENTS_PAYMENT_METHOD))
    raise ConfigError("PAYMENTS_PAYMENT_METHOD must be a Stripe PaymentMethod id (pm_ and "
                      f"letters, digits or underscores), got {_shown}")
# The Stripe API version every payments request names (Stripe-Version); empty: the account's
# default. Create the webhook endpoint at the same version: events come in its shapes.
PAYMENTS_API_VERSION = os.environ.get("PAYMENTS_API_VERSION", "2024-06-20")
if PAYMENTS_API_VERSION and not STRIPE_VERSION.fullmatch(PAYMENTS_API_VERSION):
    # Stripe refuses every request naming a version it does not know, and one with a blank at
    # either end is no header value at all: every payment would end refused or unknown. Not
    # repeated: a key pasted into the wrong variable must not reach the logs.
    raise ConfigError(
        "PAYMENTS_API_VERSION must be a Stripe API version, a date and perhaps a release name "
        "(2024-12-18.acacia) with no space at either end, or empty for the account's default"
    )
# Stripe's search index trails writes by up to a minute: an empty search younger than this
# after our last call proves nothing.
PAYMENTS_SEARCH_LAG_SECONDS = _float_env("PAYMENTS_SEARCH_LAG_SECONDS", "60", positive=False)
# "Occasionally, propagation of new or updated data can be up to an hour behind during
# outages" (Stripe's search reference): no operation is closed as never done on an empty
# search younger than this after the last moment a call could have landed.
PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS = _float_env(
    "PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS", "3600", positive=False)
CRM_API_BASE = _api_base_env("CRM_API_BASE", f"{_SANDBOX_BASE}/crm")
CRM_API_KEY = _provider_credential("CRM_API_KEY", "crm_sandbox_key", base=CRM_API_BASE)
CRM_WEBHOOK_SECRET = _provider_credential(
    "CRM_WEBHOOK_SECRET", "whsec_sandbox_crm", base=CRM_API_BASE)
MAIL_API_BASE = _api_base_env("MAIL_API_BASE", f"{_SANDBOX_BASE}/mail")
MAIL_API_KEY = _provider_credential("MAIL_API_KEY", "mail_sandbox_key", base=MAIL_API_BASE)
MAIL_WEBHOOK_SECRET = _provider_credential(
    "MAIL_WEBHOOK_SECRET", "whsec_sandbox_mail", base=MAIL_API_BASE)
PROVIDER_TIMEOUT_SECONDS = _float_env("PROVIDER_TIMEOUT_SECONDS", "10")

# The sandbox providers are served under /sandbox/ with DEBUG on, or when asked for explicitly.
SANDBOX_ENABLED = _flag_env("SANDBOX_ENABLED", False) or DEBUG
# Payments at or above this amount stay `processing` until settled, to demo async results
# (below Stripe's largest amount, 99999999, which the sandbox refuses beyond).
SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = int(
    _float_env("SANDBOX_PAYMENTS_ASYNC_FROM_MINOR", "10000000", positive=False,
               maximum=MAX_AMOUNT_MINOR)
)
# The sandbox's bank and mail server settle payments and deliver mail this long after they
# were accepted; its webhooks go to this console.
SANDBOX_SETTLE_SECONDS = _float_env("SANDBOX_SETTLE_SECONDS", "20", positive=False)
SANDBOX_WEBHOOK_TARGET = os.environ.get(
    "SANDBOX_WEBHOOK_TARGET", f"http://127.0.0.1:{local_web_port(os.environ)}"
)
for _name, _base in (("PAYMENTS_API_BASE", PAYMENTS_API_BASE), ("CRM_API_BASE", CRM_API_BASE),
                     ("MAIL_API_BASE", MAIL_API_BASE)):
    if sandbox_endpoint(_base) and not SANDBOX_ENABLED:
        # Every effect would fail against a sandbox that is not served: say so at start.
        raise ConfigError(
            f"{_name} points at the sandbox ({url_shown(_base)}), which is off with DEBUG off: "
            f"set {_name} to the provider, or SANDBOX_ENABLED=1 for a demo deployment"
        )
if SANDBOX_ENABLED:
    # The worker reaches the sandbox, and the sandbox this console's webhooks, over plain
    # http on loopback: no https redirect there, and loopback is an allowed host.
    SECURE_REDIRECT_EXEMPT += [r"^sandbox/", r"^webhooks/"]
    ALLOWED_HOSTS = [
        *ALLOWED_HOSTS, *(host for host in ("127.0.0.1", "localhost") if host not in ALLOWED_HOSTS)
    ]
    CELERY_BEAT_SCHEDULE["sandbox-tick"] = _beat_entry(
        "sandbox.tick", _float_env("SANDBOX_TICK_SECONDS", "5")
    )
