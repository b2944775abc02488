from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from console import embedded


def redis_client() -> redis.Redis:
    return redis.Redis(unix_socket_path=str(embedded._redis_socket()), socket_timeout=2,
                       retry=Retry(NoBackoff(), 0))


@pytest.fixture
def redis_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """A var/redis of the test's own: the checkout's (and any embedded server running this
    very suite) is never touched. Whatever Redis a test started there is shut down through
    its own socket, never by a pid."""
    folder = tmp_path / "redis"
    folder.mkdir()
    monkeypatch.setattr(embedded, "VAR_DIR", tmp_path)
    monkeypatch.setattr(embedded, "REDIS_DIR", folder)
    yield folder
    client = redis_client()
    try:
        client.shutdown(nosave=True)
    except redis.exceptions.RedisError:
        pass
    finally:
        client.close()


@pytest.fixture
def stale_pid_file(redis_dir) -> Iterator[subprocess.Popen]:
    """What an unclean stop (kill -9, the OOM killer, a container restart) leaves: the pid
    file and the socket file, the pid since gone to some other process of ours."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (redis_dir / "redis.pid").write_text(f"{other.pid}\n")
    embedded._redis_socket().write_text("")
    yield other
    other.kill()
    other.wait()


def ping(url: str) -> bool:
    assert url == f"redis+socket://{embedded._redis_socket()}"
    client = redis_client()
    try:
        return client.ping()
    finally:
        client.close()


def test_it_stops_the_postgres_it_started_when_redis_cannot_start(monkeypatch):
    """Only the server start/stop calls are replaced: nothing here may touch the embedded
    servers (or their state file) that may be running this very test suite."""
    calls: list[str] = []
    state: dict[str, str] = {}
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(embedded, "embedded_state", lambda: dict(state))
    monkeypatch.setattr(embedded, "_write_state", lambda new: state.update(new))
    monkeypatch.setattr(embedded, "_pg_running", lambda: False)
    monkeypatch.setattr(embedded, "_redis_pid", lambda: None)
    monkeypatch.setattr(embedded, "postgres_up", lambda: calls.append("postgres up") or "pg")
    monkeypatch.setattr(embedded, "postgres_down", lambda: calls.append("postgres down"))
    monkeypatch.setattr(embedded, "redis_down", lambda: calls.append("redis down"))

    def redis_up() -> str:
        raise embedded.EmbeddedUnavailable("redis-server is missing")

    monkeypatch.setattr(embedded, "redis_up", redis_up)

    with pytest.raises(embedded.EmbeddedUnavailable):
        embedded.services_up()

    assert calls == ["postgres up", "postgres down"]


def test_it_starts_a_fresh_redis_when_its_pid_file_names_another_process(stale_pid_file):
    """It took "that pid is alive and the socket file exists" for "our Redis runs", and
    handed out a broker URL nothing listened on: the worker, beat and every approval's
    publish then failed to connect."""
    url = embedded.redis_up()

    assert ping(url)
    assert embedded._redis_pid() not in {None, stale_pid_file.pid}
    assert stale_pid_file.poll() is None


def test_it_reuses_the_redis_it_started(redis_dir):
    url = embedded.redis_up()
    pid = embedded._redis_pid()

    assert embedded.redis_up() == url
    assert embedded._redis_pid() == pid
    assert ping(url)


def test_it_never_signals_a_process_that_is_not_its_redis(stale_pid_file, redis_dir):
    """`make services-down`, and the end of `make run`/`make test` that started Redis, sent
    SIGTERM to whatever process held the stale file's pid: tidying up after an unclean stop
    could kill an unrelated process of the same user."""
    embedded.redis_down()

    assert stale_pid_file.poll() is None
    assert not (redis_dir / "redis.pid").exists()
    assert not embedded._redis_socket().exists()
    assert embedded._redis_pid() is None


def test_it_stops_the_redis_it_started(redis_dir):
    url = embedded.redis_up()

    embedded.redis_down()

    assert not embedded._redis_socket().exists()
    assert embedded._redis_pid() is None
    with pytest.raises(redis.exceptions.ConnectionError):
        ping(url)
