"""Small helpers every test package shares (fixtures live in the conftest files)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client


def signed_in(user, **kwargs: Any) -> Client:
    """A test client with `user` signed in."""
    client = Client(**kwargs)
    client.force_login(user)
    return client


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = 30, interval: float = 0.1,
    what: str = "condition",
) -> Any:
    """Poll until `predicate()` is truthy (and return it), reading other processes' commits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        connection.close()  # a fresh snapshot each time, not one left over from the last read
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
