from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.factories import TenantFactory, UserFactory

BASE_DIR = Path(__file__).resolve().parent.parent


@pytest.fixture
def acme(db):
    return TenantFactory(slug="acme", name="Acme Corp", legal_entity="Acme Corp LLP")


@pytest.fixture
def globex(db):
    return TenantFactory(slug="globex", name="Globex", legal_entity="Globex Holdings Ltd")


def _user_with_role(username: str, role: str, tenant):
    from console.roles import role_grant, roles_setup

    roles_setup()
    user = UserFactory(username=username)
    role_grant(user=user, role=role, tenant=tenant)
    return user


@pytest.fixture
def approver(acme):
    """Granted: approves on acme."""
    return _user_with_role("approver", "Approver", acme)


@pytest.fixture
def operator(acme):
    return _user_with_role("operator", "Operator", acme)


@pytest.fixture
def auditor(acme):
    return _user_with_role("auditor", "Auditor", acme)


@pytest.fixture
def admin_user(acme):
    return _user_with_role("admin", "Admin", acme)


@pytest.fixture
def other_tenant_user(globex):
    """Other tenant: holds every role, but only on globex."""
    return _user_with_role("globex_admin", "Admin", globex)


@pytest.fixture
def stranger(db):
    """Signed in, granted on nothing."""
    return UserFactory(username="stranger")


def database_url(settings_dict: dict) -> str:
    user = quote(settings_dict.get("USER") or "")
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{quote(password)}@" if password else f"{user}@"
    host = settings_dict.get("HOST") or ""
    socket_dir = settings_dict.get("OPTIONS", {}).get("host")
    name = settings_dict["NAME"]
    if not host and socket_dir:
        return f"postgresql://{auth}/{name}?host={socket_dir}"
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"postgresql://{auth}{host}{port}/{name}"


class WorkerPool:
    """Real `celery worker` processes on their own queue, against the test database."""

    def __init__(self, queue: str, env: dict[str, str]):
        self.queue = queue
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def start(
        self, *, concurrency: int = 2, count: int = 1, extra_env=None, pool: str = "threads"
    ) -> None:
        """`pool`: threads, as deployed (README); prefork where a test needs child processes."""
        env = {**self.env, **(extra_env or {})}
        for i in range(count):
            name = f"w{len(self.procs)}-{i}-{self.queue}@%h"
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", self.queue,
                 "-n", name, "--concurrency", str(concurrency), "--pool", pool,
                 "--loglevel", "WARNING", "--without-gossip", "--without-mingle"],
                cwd=BASE_DIR, env=env, start_new_session=True,
            )
            self.procs.append(proc)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        from console.tasks import ping

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"celery worker exited with {proc.returncode}")
            try:
                if ping.apply_async(queue=self.queue).get(timeout=5) == "pong":
                    return
            except Exception:  # noqa: BLE001 - not ready yet
                time.sleep(0.2)
        raise RuntimeError("celery worker did not answer within the timeout")

    def stop(self) -> None:
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@pytest.fixture
def celery_queue(settings):
    """A queue of this test's own, so no other worker on the broker takes its tasks."""
    from console.celery import app

    queue = f"test-{uuid.uuid4().hex[:12]}"
    previous = app.conf.task_default_queue
    app.conf.task_default_queue = queue
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    yield queue
    app.conf.task_default_queue = previous


@pytest.fixture
def worker_pool(transactional_db, celery_queue):
    """Start real worker processes with `worker_pool.start()`; stopped after the test."""
    from django.db import connection

    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "REDIS_URL": __import__("django.conf").conf.settings.CELERY_BROKER_URL,
        "CELERY_QUEUE": celery_queue,
        "DEBUG": "1",
        "PYTHONUNBUFFERED": "1",
    }
    pool = WorkerPool(celery_queue, env)
    yield pool
    pool.stop()


# --- a real browser: Playwright driving Debian's Chromium (no downloads) ----------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


@pytest.fixture(scope="module")
def _async_unsafe_allowed() -> Iterator[None]:
    """Playwright's sync API runs an event loop in this thread; the ORM calls stay sync.

    Set for the modules whose tests drive a browser only: set at import it would leak into
    every subprocess of the session (`check --deploy` warns about it)."""
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture(scope="module")
def browser(_async_unsafe_allowed) -> Iterator:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's Chromium "
            "(apt-get install -y --no-install-recommends chromium); .ci/run does this."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(15_000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))

    def on_console(msg) -> None:
        # CSP violations and script errors land here; the browser's own favicon probe is not ours.
        if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico"):
            problems.append(msg.text)

    page.on("console", on_console)
    page.problems = problems
    yield page
    context.close()
