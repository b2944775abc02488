"""Environment configuration, read once by settings.

Every value is validated here so that a bad value stops the process at start with one line
naming the variable, instead of a traceback from deep inside Django or psycopg.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"
# Written by `python -m console.embedded up`; lets every process of a checkout (web, worker,
# beat, a management command in another terminal) find the same embedded servers.
EMBEDDED_STATE = VAR_DIR / "embedded.json"
# Written by `make run` while it serves: the port, so a management command in another
# terminal reaches the sandbox providers of the running console without PORT set.
DEVSERVER_STATE = VAR_DIR / "devserver.json"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(Exception):
    """A configuration variable is missing or malformed."""


@dataclass(frozen=True)
class Config:
    debug: bool
    secret_key: str
    secret_key_fallbacks: list[str]
    database_url: str
    redis_url: str
    allowed_hosts: list[str]
    csrf_trusted_origins: list[str]
    embedded_database: bool
    embedded_redis: bool


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _list(environ: Mapping[str, str], name: str, default: list[str]) -> list[str]:
    raw = environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def url_parts(name: str, raw: str) -> SplitResult:
    """`raw` split, its port checked. The line repeats none of the URL: it reaches terminals,
    CI logs and the supervisor's journal, and a URL may carry a password. A "/" (or "#", "?")
    in that password ends the host part early, so the password's start reads as the port."""
    try:
        # A "[" or "]" outside an IPv6 address (in a password, a mistyped host) makes urlsplit
        # raise: a traceback and exit status 1, which gunicorn's --preload takes for a crash.
        parts = urlsplit(raw)
    except ValueError:
        raise ConfigError(
            f"{name} is not a well-formed URL (a [ or ] not around an IPv6 address?); if it "
            "carries a password, a character in it may need percent-encoding ([ as %5B)"
        ) from None
    try:
        parts.port  # noqa: B018 - raises ValueError on a non-numeric port
    except ValueError:
        raise ConfigError(
            f"{name} has a bad port (not a number from 0 to 65535); if it carries a password, "
            "a character in it may need percent-encoding (/ as %2F)"
        ) from None
    return parts


def server_url_parts(name: str, raw: str) -> SplitResult:
    """`url_parts` of a server's URL (the database's, the broker's), whose path and query
    never hold an "@": one there came from a password with a "/" (or "#", "?") in it that
    ended the host part early. With digits after it, the port check passes it, and the
    console would reach a host named after the user, failing only at its first query."""
    parts = url_parts(name, raw)
    if "@" in parts.path or "@" in parts.query or "@" in parts.fragment:
        raise ConfigError(
            f"{name} has an @ after its host part; if it carries a password, a character in "
            "it may need percent-encoding (/ as %2F, # as %23, ? as %3F)"
        )
    return parts


def url_shown(raw: str) -> str:
    """A URL as a start-up line may name it: scheme, host and port. Its user, password, path
    and query stay out (a base may carry credentials, a query a token)."""
    parts = urlsplit(raw)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host or ''}" + (f":{parts.port}" if parts.port else "")


def local_web_port(environ: Mapping[str, str]) -> str:
    """The port this checkout's console serves on: PORT, else the one a running `make run`
    recorded, else 8000. A record left by a `make run` that is gone is ignored."""
    if environ.get("PORT"):
        raw = environ["PORT"]
        # The sandbox bases and the webhook target are built from it: a bad value would
        # otherwise surface as every provider call failing, long after the start.
        port = int(raw) if raw.strip().isdigit() else 0
        if not 0 < port < 65536:
            raise ConfigError(f"PORT={raw!r} is not a port number (1 to 65535)")
        return str(port)
    try:
        state = json.loads(DEVSERVER_STATE.read_text())
        port, pid = str(int(state["port"])), int(state["pid"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return "8000"
    try:
        os.kill(pid, 0)
    except PermissionError:
        return port  # alive, under another user
    except OSError:
        return "8000"
    return port


def embedded_state() -> dict[str, str]:
    """What `python -m console.embedded up` recorded: the servers' URLs, or nothing."""
    try:
        return json.loads(EMBEDDED_STATE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _database_url(environ: Mapping[str, str]) -> tuple[str, bool]:
    raw = environ.get("DATABASE_URL", "").strip()
    if not raw:
        url = embedded_state().get("database_url")
        if not url:
            raise ConfigError(
                "DATABASE_URL is not set and the embedded PostgreSQL is not running; "
                "start it with `make services` (or `make run`), or set DATABASE_URL"
            )
        return url, True
    parts = server_url_parts("DATABASE_URL", raw)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ConfigError(
            f"DATABASE_URL must be a PostgreSQL URL (postgresql://user@host:5432/name), "
            f"got scheme {parts.scheme!r}"
        )
    if not parts.path.strip("/"):
        raise ConfigError("DATABASE_URL names no database (postgresql://user@host:5432/NAME)")
    return raw, False


def _redis_url(environ: Mapping[str, str]) -> tuple[str, bool]:
    raw = environ.get("REDIS_URL", "").strip()
    if not raw:
        url = embedded_state().get("redis_url")
        if not url:
            raise ConfigError(
                "REDIS_URL is not set and the embedded Redis is not running; "
                "start it with `make services` (or `make run`), or set REDIS_URL"
            )
        return url, True
    parts = server_url_parts("REDIS_URL", raw)
    if parts.scheme not in {"redis", "rediss", "redis+socket"}:
        raise ConfigError(
            f"REDIS_URL must be a Redis URL (redis://host:6379/0), got scheme {parts.scheme!r}"
        )
    return raw, False


def _secret_key(environ: Mapping[str, str], debug: bool) -> str:
    raw = environ.get("SECRET_KEY", "")
    if raw:
        if not debug and (len(raw) < 50 or raw.startswith("django-insecure")):
            raise ConfigError("SECRET_KEY must be at least 50 random characters when DEBUG is off")
        return raw
    if not debug:
        raise ConfigError("SECRET_KEY must be set when DEBUG is off")
    # A development checkout keeps one generated key so sessions survive restarts.
    key_file = VAR_DIR / "secret_key"
    if key_file.exists():
        return key_file.read_text().strip()
    VAR_DIR.mkdir(exist_ok=True)
    key = secrets.token_urlsafe(64)
    key_file.write_text(key)
    key_file.chmod(0o600)
    return key


def _secret_key_fallbacks(environ: Mapping[str, str], debug: bool) -> list[str]:
    # The keys SECRET_KEY replaced, while their sessions, password reset links and the
    # journal's keyed digests made under them are still about: without them a rotation signs
    # everyone out and makes our own kept mail reports look foreign.
    fallbacks = _list(environ, "SECRET_KEY_FALLBACKS", [])
    if not debug and any(len(key) < 50 or key.startswith("django-insecure") for key in fallbacks):
        raise ConfigError(
            "SECRET_KEY_FALLBACKS must list keys of at least 50 random characters each"
        )
    return fallbacks


def _allowed_host_check(position: int, host: str) -> None:
    # Django matches the request's host, its port cut off, against each entry as it is: a
    # URL there (the form CSRF_TRUSTED_ORIGINS asks for), a port or a path never matches, and
    # every request, /healthz included, would be answered 400 after `check --deploy` passed.
    # An IPv6 address comes in brackets ([::1]); ".example.com" and "*" are Django's patterns.
    if "/" in host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ConfigError(
            f"ALLOWED_HOSTS entry {position} is a URL or has a port or path; list host names "
            "alone (console.example.com, .example.com, [::1]), as the request's Host is matched"
        )


def read_config(environ: Mapping[str, str]) -> Config:
    database_url, embedded_database = _database_url(environ)
    # The embedded database only exists on a development checkout (a deployment always
    # names its DATABASE_URL), so there DEBUG defaults to on and a management command in a
    # second terminal works with no variables; everywhere else it defaults to off.
    debug = env_flag(environ, "DEBUG", default=embedded_database)
    redis_url, embedded_redis = _redis_url(environ)
    default_hosts = ["127.0.0.1", "localhost", "[::1]"] if debug else []
    allowed_hosts = _list(environ, "ALLOWED_HOSTS", default_hosts)
    if not debug and not allowed_hosts:
        raise ConfigError("ALLOWED_HOSTS must list the site's host names when DEBUG is off")
    for position, host in enumerate(allowed_hosts, start=1):
        _allowed_host_check(position, host)
    origins = _list(environ, "CSRF_TRUSTED_ORIGINS", [])
    for origin in origins:
        if url_parts("CSRF_TRUSTED_ORIGINS", origin).scheme not in {"http", "https"}:
            raise ConfigError(
                f"CSRF_TRUSTED_ORIGINS entry {origin!r} must start with https:// or http://"
            )
    return Config(
        debug=debug,
        secret_key=_secret_key(environ, debug),
        secret_key_fallbacks=_secret_key_fallbacks(environ, debug),
        database_url=database_url,
        redis_url=redis_url,
        allowed_hosts=allowed_hosts,
        csrf_trusted_origins=origins,
        embedded_database=embedded_database,
        embedded_redis=embedded_redis,
    )


# A configuration error's exit status everywhere. 3 is gunicorn's "worker failed to boot":
# the server then stops, instead of respawning the worker in a loop that prints the line
# forever.
CONFIG_ERROR_EXIT = 3


def settings_load_or_exit() -> None:
    """Load Django's settings now, at the start of a process (manage.py, gunicorn's app, the
    Celery app as it configures): a bad value stops it with one line naming the variable,
    not a traceback from wherever the settings happened to be read first."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    try:
        from django.conf import settings

        settings.INSTALLED_APPS  # noqa: B018 - loads the settings
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
