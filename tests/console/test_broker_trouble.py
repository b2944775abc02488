"""A broker that is down, or that accepts connections and never answers (a failover's client
pause, a stuck Redis, a peer gone behind a NAT that drops packets). Nothing waits on it for
good: not the request that approved a payment (after its commit), not the health check, not
the deployer's worker_ping."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import BASE_DIR, database_url


@pytest.fixture
def hung_broker() -> Iterator[str]:
    """A Redis that accepts connections and never answers: what a client sees during a
    failover's CLIENT PAUSE, a stuck Redis, or a peer gone behind a NAT that drops packets."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def _run_with_broker(code: str, broker: str, *, timeout: float) -> subprocess.CompletedProcess:
    from django.db import connection

    env = {**os.environ, "REDIS_URL": broker, "DEBUG": "1",
           "DATABASE_URL": database_url(connection.settings_dict),
           "DJANGO_SETTINGS_MODULE": "console.settings", "PYTHONPATH": str(BASE_DIR)}
    return subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env,
                          capture_output=True, text=True, timeout=timeout)


ENQUEUE_AFTER_COMMIT = """
import time, django
django.setup()
from django.db import transaction
from operations.tasks import execute_on_commit
start = time.monotonic()
with transaction.atomic():
    execute_on_commit("op_01REVIEWHUNGBROKER")  # as approval_approve does
print(f"returned after {time.monotonic() - start:.1f}s")
"""


@pytest.mark.django_db
def test_it_returns_from_an_approval_commit_when_the_broker_does_not_answer(hung_broker):
    # robust=True turns a broker that refuses into a logged error; one that accepts the
    # connection and never answers blocked the approver's request (after its commit) for
    # good, until the broker's sockets had a timeout. The sweep queues the execute later.
    try:
        done = _run_with_broker(ENQUEUE_AFTER_COMMIT, hung_broker, timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("execute_on_commit() still blocked 40 s after the commit: the request "
                    "that approved the payment never answers (gunicorn kills it: a 502)")
    assert "returned after" in done.stdout, done.stderr[-2000:]


HEALTH = """
import time, django
django.setup()
from django.test import RequestFactory
from console.views import healthz
start = time.monotonic()
response = healthz(RequestFactory().get("/healthz"))
print(response.status_code, f"after {time.monotonic() - start:.1f}s")
"""


@pytest.mark.django_db
def test_it_reports_a_hung_broker_as_down_in_the_health_check(hung_broker):
    try:
        done = _run_with_broker(HEALTH, hung_broker, timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("/healthz still had not answered after 40 s with a hung broker")
    assert done.stdout.startswith("503"), done.stdout + done.stderr[-2000:]


def test_it_says_in_one_line_within_its_timeout_that_the_broker_is_down():
    env = {**os.environ, "DEBUG": "1", "REDIS_URL": "redis://127.0.0.1:1/0"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "manage.py", "worker_ping", "--timeout", "1"],
        cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120,
    )
    # It took about 20 s whatever the timeout (the result store's reconnects), logged 20
    # lines, and then said no worker answered.
    assert time.monotonic() - started < 15
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "CommandError: the broker is unreachable: "
        "Error 111 connecting to 127.0.0.1:1. Connection refused."
    ]
