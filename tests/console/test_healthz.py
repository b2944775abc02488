from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client


@pytest.mark.django_db
def test_it_reports_database_and_broker_up():
    response = Client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"database": "ok", "broker": "ok", "status": "ok"}


@pytest.mark.django_db
def test_it_answers_a_head_probe_as_it_answers_get():
    """Uptime monitors often probe with HEAD: a 405 reported the console down."""
    response = Client().head("/healthz")
    assert (response.status_code, response.content) == (200, b"")
    assert Client().post("/healthz").status_code == 405


@pytest.mark.django_db
def test_it_returns_503_when_the_broker_is_down(settings):
    from console.celery import app

    previous = app.conf.broker_url
    # A port nothing listens on: a real refused connection, not a mock.
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    try:
        response = Client().get("/healthz")
    finally:
        app.conf.broker_url = previous
    assert response.status_code == 503
    assert response.json()["broker"] == "down"
    assert response.json()["database"] == "ok"


@pytest.mark.django_db(transaction=True)
def test_it_returns_503_when_the_database_is_down():
    saved = dict(connection.settings_dict)
    saved_options = dict(saved.get("OPTIONS", {}))
    connection.close()
    connection.settings_dict["HOST"] = "127.0.0.1"
    connection.settings_dict["PORT"] = "1"
    connection.settings_dict["OPTIONS"] = {
        k: v for k, v in saved_options.items() if k != "host"
    } | {"connect_timeout": 2}
    try:
        response = Client().get("/healthz")
    finally:
        connection.close()
        connection.settings_dict.update(saved)
        connection.settings_dict["OPTIONS"] = saved_options
    assert response.status_code == 503
    assert response.json()["database"] == "down"
