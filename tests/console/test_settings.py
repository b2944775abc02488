from __future__ import annotations

import os
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
        ({"DEBUG": "1", "CSRF_TRUSTED_ORIGINS": "console.example.com"}, "CSRF_TRUSTED_ORIGINS"),
        # A real provider never falls back to the sandbox's published credentials.
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "PAYMENTS_API_BASE": "https://api.stripe.com", "PAYMENTS_API_KEY": "sk_live_x"},
         "PAYMENTS_WEBHOOK_SECRET"),
        ({"DEBUG": "0", "SECRET_KEY": "k" * 60, "ALLOWED_HOSTS": "x.example.com",
          "CRM_API_BASE": "https://crm.example.com/api"}, "CRM_API_KEY"),
    ],
)
def test_it_fails_at_start_with_one_line_naming_the_variable(overrides, variable):
    result = run_check(**overrides)
    assert result.returncode == 2
    assert variable in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_it_passes_check_deploy_with_production_values():
    env = {
        "DEBUG": "0",
        "SECRET_KEY": "x7" * 30 + "-production-secret",
        "ALLOWED_HOSTS": "console.example.com",
        "CSRF_TRUSTED_ORIGINS": "https://console.example.com",
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
