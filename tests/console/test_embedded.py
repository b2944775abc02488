from __future__ import annotations

import pytest

from console import embedded


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
