from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parents[2]


def run_check(**env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}
    env.update(
        DATABASE_URL="postgresql://postgres@127.0.0.1:5432/console",
        REDIS_URL="redis://127.0.0.1:6379/0",
    )
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=BASE_DIR, env=env,
        capture_output=True, text=True, timeout=60,
    )


PROVIDERS = {
    "PAYMENTS_API_BASE": "https://api.stripe.com", "PAYMENTS_API_KEY": "sk_live_x",
    "PAYMENTS_WEBHOOK_SECRET": "whsec_live_x", "PAYMENTS_PAYMENT_METHOD": "pm_1Live",
    "CRM_API_BASE": "https://crm.example.com/api", "CRM_API_KEY": "crm_live",
    "CRM_WEBHOOK_SECRET": "crm_whsec", "MAIL_API_BASE": "https://mail.example.com/api",
    "MAIL_API_KEY": "mail_live", "MAIL_WEBHOOK_SECRET": "mail_whsec",
}


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"DATABASE_URL": "mysql://root@localhost/console", "DEBUG": "1"}, "DATABASE_URL"),
        ({"DATABASE_URL": "postgresql://postgres@localhost:54x/console", "DEBUG": "1"},
         "DATABASE_URL"),
        ({"REDIS_URL": "http://localhost:6379", "DEBUG": "1"}, "REDIS_URL"),
        ({"DEBUG": "maybe"}, "DEBUG"),
        ({"DEBUG": "0", "ALLOWED_HOSTS": "console.example.com"}, "SECRET_KEY"),
        ({"DEBUG": "0", "SECRET_KEY": "short", "ALLOWED_HOSTS": "x.example.com"}, "SECRET_KEY"),
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60}, "ALLOWED_HOSTS"),
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "SECRET_KEY_FALLBACKS": "old"}, "SECRET_KEY_FALLBACKS"),
        ({"DEBUG": "1", "CSRF_TRUSTED_ORIGINS": "console.example.com"}, "CSRF_TRUSTED_ORIGINS"),
        # A real provider never falls back to the sandbox's published credentials.
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "https://api.stripe.com", "PAYMENTS_API_KEY": "sk_live_x"},
         "PAYMENTS_WEBHOOK_SECRET"),
        # Stripe confirms no payment without one; the sandbox's is a test-mode id.
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "https://api.stripe.com", "PAYMENTS_API_KEY": "sk_live_x",
          "PAYMENTS_WEBHOOK_SECRET": "whsec_live_x"}, "PAYMENTS_PAYMENT_METHOD"),
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "CRM_API_BASE": "https://crm.example.com/api"}, "CRM_API_KEY"),
        ({"DEBUG": "1", "OPERATION_LEASE_SECONDS": "thirty"}, "OPERATION_LEASE_SECONDS"),
        ({"DEBUG": "1", "SANDBOX_ENABLED": "maybe"}, "SANDBOX_ENABLED"),
        ({"DEBUG": "1", "SECURE_PROXY_SSL_HEADER": "https"}, "SECURE_PROXY_SSL_HEADER"),
        # Used only with DEBUG off, checked whatever DEBUG, as SECURE_SSL_REDIRECT is.
        ({"DEBUG": "1", "SECURE_SSL_REDIRECT": "maybe"}, "SECURE_SSL_REDIRECT"),
        ({"DEBUG": "1", "SECURE_HSTS_SECONDS": "one year"}, "SECURE_HSTS_SECONDS"),
        ({"DEBUG": "1", "PROVIDER_TIMEOUT_SECONDS": "10s"}, "PROVIDER_TIMEOUT_SECONDS"),
        # Numbers that pace or bound something: a beat of 0 s sends its sweep hundreds of
        # times a second; a negative or endless timeout is no timeout.
        ({"DEBUG": "1", "OPERATION_SWEEP_SECONDS": "0"}, "OPERATION_SWEEP_SECONDS"),
        ({"DEBUG": "1", "PROVIDER_TIMEOUT_SECONDS": "-1"}, "PROVIDER_TIMEOUT_SECONDS"),
        ({"DEBUG": "1", "PROVIDER_TIMEOUT_SECONDS": "nan"}, "PROVIDER_TIMEOUT_SECONDS"),
        ({"DEBUG": "1", "PROVIDER_TIMEOUT_SECONDS": "inf"}, "PROVIDER_TIMEOUT_SECONDS"),
        ({"DEBUG": "1", "OPERATION_MAX_AUTOMATIC_CALLS": "0"}, "OPERATION_MAX_AUTOMATIC_CALLS"),
        ({"DEBUG": "1", "PAYMENTS_SEARCH_LAG_SECONDS": "-10"}, "PAYMENTS_SEARCH_LAG_SECONDS"),
        ({"DEBUG": "1", "ACCEPTED_LOOKUP_FAILING_SECONDS": "0"}, "ACCEPTED_LOOKUP_FAILING_SECONDS"),
        # Numbers no clock can hold: the lockout's timedelta overflowed at settings import
        # (a traceback), the lease and re-check in every operation's execute long after.
        ({"DEBUG": "1", "LOGIN_LOCKOUT_MINUTES": "100000000000000000"}, "LOGIN_LOCKOUT_MINUTES"),
        ({"DEBUG": "1", "OPERATION_LEASE_SECONDS": "100000000000000"}, "OPERATION_LEASE_SECONDS"),
        ({"DEBUG": "1", "EXECUTE_RECHECK_SECONDS": "100000000000000"}, "EXECUTE_RECHECK_SECONDS"),
        ({"DEBUG": "1", "OPERATION_MAX_AUTOMATIC_CALLS": "10000000000"},
         "OPERATION_MAX_AUTOMATIC_CALLS"),
        # A real provider whose path says "sandbox" is still a real provider.
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "https://pay.example.com/sandbox/v1"}, "PAYMENTS_API_KEY"),
        # A provider base httpx cannot call: refused at start, not at every call.
        ({**PROVIDERS, "DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "api.stripe.com"}, "PAYMENTS_API_BASE"),
        ({**PROVIDERS, "DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "api.stripe.com/v1"}, "PAYMENTS_API_BASE"),
        ({**PROVIDERS, "DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "ftp://api.stripe.com"}, "PAYMENTS_API_BASE"),
        ({"DEBUG": "1", "CRM_API_BASE": "https:///api"}, "CRM_API_BASE"),
        ({"DEBUG": "1", "MAIL_API_BASE": "https://mail.example.com:25x/api"}, "MAIL_API_BASE"),
        # The default providers are the sandbox, which is not served with DEBUG off.
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com"},
         "PAYMENTS_API_BASE"),
    ],
)
def test_it_fails_at_start_with_one_line_naming_the_variable(overrides, variable):
    result = run_check(**overrides)
    assert result.returncode == 3  # CONFIG_ERROR_EXIT
    assert variable in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("value", [
    "pm_1Live ",  # a trailing space from an env file
    "card visa",  # not an id at all
    "sk_live_0123456789ab",  # the API key pasted into the wrong variable
])
def test_it_refuses_a_payment_method_that_is_no_stripe_id_at_start(value):
    # Taken as it was, every payment a person approved was refused by the provider after
    # the approval, and a pasted key went out as a request parameter.
    result = run_check(**{
        **PROVIDERS, "DEBUG": "0", "SECRET_KEY": "x7" * 30 + "-production-secret",
        "ALLOWED_HOSTS": "console.example.com", "PAYMENTS_PAYMENT_METHOD": value,
    })
    assert result.returncode == 3, result.stderr
    assert "PAYMENTS_PAYMENT_METHOD" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    if value.startswith("sk_"):
        assert "0123456789ab" not in result.stderr
    else:
        assert repr(value) in result.stderr


def test_it_keeps_the_keys_a_rotation_replaced_as_fallbacks():
    # Sessions, reset links and the journal's keyed mail digests made under the old key
    # still verify while a rotation settles: Django reads SECRET_KEY_FALLBACKS for that.
    from console.env import ConfigError, read_config

    deployed = {"DEBUG": "0", "SECRET_KEY": "n" * 60, "ALLOWED_HOSTS": "x.example.com",
                "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/console",
                "REDIS_URL": "redis://127.0.0.1:6379/0"}
    assert read_config(deployed).secret_key_fallbacks == []
    rotated = read_config({**deployed, "SECRET_KEY_FALLBACKS": f"{'o' * 60}, {'p' * 60}"})
    assert rotated.secret_key_fallbacks == ["o" * 60, "p" * 60]
    with pytest.raises(ConfigError, match="SECRET_KEY_FALLBACKS") as refused:
        read_config({**deployed, "SECRET_KEY_FALLBACKS": f"{'o' * 60},django-insecure-x"})
    assert "o" * 60 not in str(refused.value)


def test_it_takes_numbers_up_to_the_documented_maximum():
    """Ten years for a duration, a billion for a count: the README's rule, both ends."""
    ten_years = str(10 * 365 * 24 * 3600)
    result = run_check(DEBUG="1", OPERATION_LEASE_SECONDS=ten_years,
                       EXECUTE_RECHECK_SECONDS=ten_years, SECURE_HSTS_SECONDS=ten_years,
                       LOGIN_LOCKOUT_MINUTES=str(10 * 365 * 24 * 60),
                       LOGIN_FAILURE_LIMIT="1000000000")
    assert result.returncode == 0, result.stderr
    result = run_check(DEBUG="1", OPERATION_LEASE_SECONDS=str(int(ten_years) + 1))
    assert result.returncode == 3
    assert result.stderr.strip() == (
        f"configuration error: OPERATION_LEASE_SECONDS='{int(ten_years) + 1}' "
        f"must be at most {ten_years}"
    )




def test_it_starts_a_demo_deployment_whose_sandbox_reaches_itself_over_loopback():
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import "
         "settings as s; print(s.ALLOWED_HOSTS, s.SECURE_REDIRECT_EXEMPT, "
         "'sandbox-tick' in s.CELERY_BEAT_SCHEDULE, "
         "sorted({e['options']['expires'] for e in s.CELERY_BEAT_SCHEDULE.values()}))"],
        cwd=BASE_DIR, capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}},
             "DJANGO_SETTINGS_MODULE": "console.settings",
             "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/console",
             "REDIS_URL": "redis://127.0.0.1:6379/0", "DEBUG": "0", "SECRET_KEY": "k" * 60,
             "ALLOWED_HOSTS": "demo.example.com", "SANDBOX_ENABLED": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "['demo.example.com', '127.0.0.1', 'localhost'] "
        "['^healthz$', '^sandbox/', '^webhooks/'] True [300.0]"
    )


SANDBOX_CREDENTIALS = {
    "PAYMENTS_API_KEY": "sk_test_sandbox", "PAYMENTS_WEBHOOK_SECRET": "whsec_sandbox_payments",
    "CRM_API_KEY": "crm_sandbox_key", "CRM_WEBHOOK_SECRET": "whsec_sandbox_crm",
    "MAIL_API_KEY": "mail_sandbox_key", "MAIL_WEBHOOK_SECRET": "whsec_sandbox_mail",
}


def _credentials(**env_overrides: str) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", "import json, django; django.setup(); from django.conf import "
         "settings as s; print(json.dumps({n: getattr(s, n) for n in "
         f"{list(SANDBOX_CREDENTIALS)}}}))"],
        cwd=BASE_DIR, capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items()
                if k not in {"DEBUG", "SECRET_KEY", *SANDBOX_CREDENTIALS}},
             "DJANGO_SETTINGS_MODULE": "console.settings",
             "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/console",
             "REDIS_URL": "redis://127.0.0.1:6379/0", **env_overrides},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_it_never_serves_a_demo_deployments_sandbox_with_the_published_credentials():
    # With DEBUG off the sandbox is served to the world: with the key and webhook secrets
    # printed in settings.py anyone could call it, read every tenant's effects there, and
    # sign webhooks that settle any tenant's operations.
    demo = {"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "demo.example.com",
            "SANDBOX_ENABLED": "1"}
    credentials = _credentials(**demo)
    for name, published in SANDBOX_CREDENTIALS.items():
        assert credentials[name] != published, name
    # The web process, the worker and beat derive the same values from the same SECRET_KEY.
    assert _credentials(**demo) == credentials
    other = _credentials(**{**demo, "SECRET_KEY": "q" * 60})
    assert all(other[name] != credentials[name] for name in SANDBOX_CREDENTIALS)
    # A value the deployer sets wins; a development checkout keeps the published ones.
    assert _credentials(**demo, CRM_API_KEY="crm_chosen")["CRM_API_KEY"] == "crm_chosen"
    assert _credentials(DEBUG="1") == SANDBOX_CREDENTIALS


def test_it_passes_check_deploy_with_production_values():
    env = {
        "DEBUG": "0",
        "SECRET_KEY": "x7" * 30 + "-production-secret",
        "ALLOWED_HOSTS": "console.example.com",
        "CSRF_TRUSTED_ORIGINS": "https://console.example.com",
        **PROVIDERS,
    }
    result = run_check(**env)
    assert result.returncode == 0, result.stderr
    deploy = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=BASE_DIR, capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}},
             "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/console",
             "REDIS_URL": "redis://127.0.0.1:6379/0", **env},
    )
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "no issues" in deploy.stdout


def _celery_queues(**env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}
    env.update(DATABASE_URL="postgresql://postgres@127.0.0.1:5432/console",
               REDIS_URL="redis://127.0.0.1:6379/0", DEBUG="1", **env_overrides)
    return subprocess.run(
        [sys.executable, "-c",
         "from console.env import settings_load_or_exit; settings_load_or_exit()\n"
         "from console.celery import app\n"
         "import json\n"
         "route = app.amqp.router.route({}, 'operations.execute_operation')\n"
         "print(json.dumps({'consumed': sorted(app.amqp.queues),"
         " 'sent_to': route['queue'].name if 'queue' in route else None}))"],
        cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("blank", ["", " "])
def test_it_never_starts_a_worker_that_listens_on_no_queue(blank):
    """`CELERY_QUEUE=` (an env file's blank line, compose's `${CELERY_QUEUE}` unset) set the
    default queue to "": the worker started "ready" with no queue, and every execute,
    reconcile and sweep message went where nothing consumes it. Blank is unset."""
    result = _celery_queues(CELERY_QUEUE=blank)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"consumed": ["console"], "sent_to": "console"}
    named = json.loads(_celery_queues(CELERY_QUEUE="console-eu").stdout)
    assert named == {"consumed": ["console-eu"], "sent_to": "console-eu"}


def test_it_creates_the_folder_of_beats_schedule_file(tmp_path):
    schedule = tmp_path / "fresh" / "var" / "celerybeat-schedule"
    result = subprocess.run(
        [sys.executable, "-c", "from console.celery import app; "
         "print(app.conf.beat_schedule_filename)"],
        cwd=BASE_DIR, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DEBUG": "1", "CELERY_BEAT_SCHEDULE_FILENAME": str(schedule),
             "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/console",
             "REDIS_URL": "redis://127.0.0.1:6379/0"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(schedule)
    assert schedule.parent.is_dir()


def test_it_finds_the_port_of_the_running_make_run_for_a_second_terminal(tmp_path, monkeypatch):
    from console import env

    state = tmp_path / "devserver.json"
    monkeypatch.setattr(env, "DEVSERVER_STATE", state)
    assert env.local_web_port({}) == "8000"  # nothing running
    state.write_text(json.dumps({"port": "8001", "pid": os.getpid()}))
    assert env.local_web_port({}) == "8001"
    assert env.local_web_port({"PORT": "8002"}) == "8002"  # the variable wins
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    state.write_text(json.dumps({"port": "8001", "pid": int(gone.stdout)}))
    assert env.local_web_port({}) == "8000"  # left behind by a `make run` that is gone
    state.write_text("{")
    assert env.local_web_port({}) == "8000"

    class Unreadable:  # written by another user under a strict umask
        def read_text(self) -> str:
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(env, "DEVSERVER_STATE", Unreadable())
    assert env.local_web_port({}) == "8000"  # not a crash at settings import


def readme_gunicorn_argv() -> list[str]:
    """gunicorn as the README's Deploying starts it (four workers failing at once made its
    arbiter exit 1 with tracebacks, unless the settings load once before forking)."""
    line = next(line for line in (BASE_DIR / "README.md").read_text().splitlines()
                if line.startswith(".venv/bin/gunicorn "))
    args = shlex.split(line)[1:]
    args[args.index("--bind") + 1] = "127.0.0.1:0"
    return ["-m", "gunicorn", *args]


@pytest.mark.parametrize("argv", [
    readme_gunicorn_argv(),
    ["-m", "celery", "-A", "console", "worker"],
    ["-m", "celery", "-A", "console", "beat"],
])
def test_it_stops_the_server_worker_and_beat_with_one_line_on_a_bad_setting(argv):
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}
    env.update(DATABASE_URL="postgresql://postgres@127.0.0.1:5432/console",
               REDIS_URL="redis://127.0.0.1:6379/0", DEBUG="0",
               ALLOWED_HOSTS="console.example.com")
    result = subprocess.run([sys.executable, *argv], cwd=BASE_DIR, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3  # gunicorn halts ("worker failed to boot"), no respawn loop
    assert "configuration error: SECRET_KEY must be set when DEBUG is off" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("configuration error") == 1


def test_it_reads_no_settings_when_make_run_and_make_test_start():
    """`make run` and `make test` import the console package (console.devserver,
    console.embedded) before the embedded servers exist: that import must not need them."""
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}
    env.update(DATABASE_URL="mysql://nobody@nowhere/none", REDIS_URL="nope://")
    result = subprocess.run(
        [sys.executable, "-c", "import console.devserver, console.embedded; print('ok')"],
        cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_it_takes_a_log_level_in_any_case_and_refuses_an_unknown_one_in_one_line():
    """LOG_LEVEL is a configuration variable like the others: `debug` is a level, and a typo
    stops the start with one line naming it, not a traceback from logging.config."""
    assert run_check(DEBUG="1", LOG_LEVEL="debug").returncode == 0
    result = run_check(DEBUG="1", LOG_LEVEL="verbose")
    assert result.returncode == 3  # CONFIG_ERROR_EXIT
    assert "LOG_LEVEL" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("port", ["eighty", "0", "70000"])
def test_it_refuses_a_port_that_is_not_a_port_number_in_one_line(port):
    """PORT names where the sandbox and its webhooks are reached: a value no server can
    listen on stops the start, not every provider call later."""
    result = run_check(DEBUG="1", PORT=port)
    assert result.returncode == 3  # CONFIG_ERROR_EXIT
    assert "PORT" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


DEPLOYED = {**PROVIDERS, "DEBUG": "0", "SECRET_KEY": "x7" * 30 + "-production-secret",
            "ALLOWED_HOSTS": "console.example.com"}


def _one_line_naming(result: subprocess.CompletedProcess, variable: str) -> None:
    assert result.returncode == 3, result.stderr  # CONFIG_ERROR_EXIT
    assert variable in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr


# Part of a generated password (base64 ones carry "/" and "+"), not percent-encoded.
PASSWORD_HEAD = "Xk9pQ2"


@pytest.mark.parametrize(("variable", "url"), [
    ("DATABASE_URL", f"postgresql://console:{PASSWORD_HEAD}/zs8Lm@db.internal:5432/console"),
    ("REDIS_URL", f"redis://:{PASSWORD_HEAD}/zs8Lm@redis.internal:6379/0"),
    ("PAYMENTS_API_BASE", f"https://acct:{PASSWORD_HEAD}/zs8Lm@pay.example.com/v1"),
])
def test_it_never_prints_the_password_of_a_url_it_refuses(variable, url):
    """A "/" in the password makes the password's start read as the port. The line goes to
    terminals, CI logs and the supervisor's journal: it says the port is bad and why that may
    be, never repeating the password."""
    result = run_check(**{**DEPLOYED, variable: url})
    _one_line_naming(result, variable)
    assert PASSWORD_HEAD not in result.stderr, result.stderr
    assert "percent-encoding" in result.stderr


@pytest.mark.parametrize(("variable", "url"), [
    ("DATABASE_URL", "postgresql://console:4471/zs8Lm@db.internal:5432/console"),
    ("DATABASE_URL", "postgresql://console:4471#zs8Lm@db.internal:5432/console"),
    ("REDIS_URL", "redis://:4471?zs8Lm@redis.internal:6379/0"),
    # A user named user@server, as some managed PostgreSQL services name them.
    ("DATABASE_URL", "postgresql://console@myserver:4471/zs8Lm@myserver.example.com:5432/c"),
])
def test_it_refuses_a_server_url_whose_password_begins_with_digits_then_a_slash(
    variable, url
):
    """Its digits read as a port that passes the port check: the console started and sent
    every query to a host named after the user."""
    result = run_check(**{**DEPLOYED, variable: url})
    _one_line_naming(result, variable)
    assert "4471" not in result.stderr and "zs8Lm" not in result.stderr, result.stderr
    assert "percent-encoding" in result.stderr


@pytest.mark.parametrize(("overrides", "variable"), [
    # A real provider without its key: the line names where the base points.
    ({"PAYMENTS_API_KEY": ""}, "PAYMENTS_API_KEY"),
    ({"PAYMENTS_PAYMENT_METHOD": ""}, "PAYMENTS_PAYMENT_METHOD"),
    # A sandbox base (loopback, under /sandbox/) with the sandbox off.
    ({"CRM_API_BASE": "http://acct:Zq81mPw@127.0.0.1:8000/sandbox/crm?token=tQ9v"},
     "CRM_API_BASE"),
])
def test_it_names_a_provider_base_without_its_credentials(overrides, variable):
    """A base may carry a user and password, or a token in its query: a start-up line that
    names it shows its scheme, host and port, never those."""
    base = "https://acct:Zq81mPw@pay.example.com:8443/v1?token=tQ9v"
    result = run_check(**{**DEPLOYED, "PAYMENTS_API_BASE": base, **overrides})
    _one_line_naming(result, variable)
    assert "Zq81mPw" not in result.stderr and "tQ9v" not in result.stderr, result.stderr
    shown = ("http://127.0.0.1:8000" if variable == "CRM_API_BASE"
             else "https://pay.example.com:8443")
    assert f"({shown})" in result.stderr, result.stderr


@pytest.mark.parametrize(("variable", "value"), [
    ("DATABASE_URL", "postgresql://console:pa[ss@db.internal:5432/console"),
    ("REDIS_URL", "redis://:pa]ss@redis.internal:6379/0"),
    ("PAYMENTS_API_BASE", "https://[pay.example.com/v1"),
    ("PAYMENTS_API_BASE", "https://acct:p[a]ss@pay.example.com/v1"),
    ("CSRF_TRUSTED_ORIGINS", "https://[console.example.com"),
])
def test_it_refuses_a_url_with_a_stray_bracket_in_one_line(variable, value):
    """A password with "[" or "]" (or a mistyped IPv6 host) made urlsplit raise: a
    traceback and exit status 1, which gunicorn's --preload does not treat as "halt"."""
    result = run_check(**{**DEPLOYED, variable: value})
    _one_line_naming(result, variable)
    assert "ss@" not in result.stderr and "example.com" not in result.stderr


@pytest.mark.parametrize(("variable", "value"), [
    # A Kubernetes secret made --from-file, a `$(cat key.txt)`: the file's newline comes along.
    ("PAYMENTS_API_KEY", "sk_live_51RevIewKey0123456789\n"),
    ("PAYMENTS_WEBHOOK_SECRET", "whsec_RevIewSecret0123456789 "),
    ("CRM_API_KEY", " crm_live_RevIewKey0123456789"),
    ("MAIL_WEBHOOK_SECRET", "mail_whsec_RevIewSecret\r\n0123456789"),
    ("PAYMENTS_API_VERSION", "2024-06-20 "),
])
def test_it_never_starts_with_a_provider_value_no_request_can_carry(variable, value):
    """A key or version with a space or newline at either end is no header value: httpx
    refused every request ("Illegal header value"), a transport error, so every approved
    effect of that provider ended unknown, long after a start that looked fine (and a webhook
    secret with one failed every signature). Refused at start, never repeating the value."""
    import socket

    import httpx

    with socket.socket() as listener:  # a server that is there: the request itself fails
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(httpx.LocalProtocolError), httpx.Client() as client:
            client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/",
                       headers={"X-Value": value.strip() + " "}, timeout=2)

    result = run_check(**{**DEPLOYED, variable: value})
    _one_line_naming(result, variable)
    assert value.strip()[-8:] not in result.stderr  # never the secret itself


@pytest.mark.parametrize("version", ["2024-06-20", "2024-12-18.acacia", ""])
def test_it_takes_a_stripe_api_version_or_none(version):
    """Empty is the account's default, as the README says."""
    result = run_check(**{**DEPLOYED, "PAYMENTS_API_VERSION": version})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("hosts", [
    "https://console.example.com",
    "console.example.com, console.example.com/console",
    "console.example.com:443",
    "[::1]:8000",
])
def test_it_refuses_allowed_hosts_given_as_urls(hosts):
    """"comma-separated host names; required with DEBUG off": a URL there (the form the next
    variable, CSRF_TRUSTED_ORIGINS, asks for), a port or a path was taken, `check --deploy`
    passed, and every request, /healthz included, was answered 400 Bad Request."""
    from django.http.request import validate_host

    assert not validate_host("console.example.com", ["https://console.example.com"])
    assert not validate_host("console.example.com", ["console.example.com:443"])
    result = run_check(**{**DEPLOYED, "ALLOWED_HOSTS": hosts})
    _one_line_naming(result, "ALLOWED_HOSTS")


def test_it_takes_the_host_patterns_django_matches():
    result = run_check(**{**DEPLOYED,
                          "ALLOWED_HOSTS": "console.example.com,.example.com,*,[::1],10.0.0.5"})
    assert result.returncode == 0, result.stderr


def test_it_refuses_a_number_of_front_servers_that_is_no_number():
    result = run_check(DEBUG="1", FORWARDING_PROXIES="nginx")
    assert result.returncode == 3
    assert result.stderr.strip() == (
        "configuration error: FORWARDING_PROXIES='nginx' is not a whole number")
    assert run_check(DEBUG="1", FORWARDING_PROXIES="2").returncode == 0
