"""Small helpers every test package shares (fixtures live in the conftest files)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from tests.factories import PASSWORD


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


class Background:
    """Run `target` in a thread on its own database connection (closed when it ends), as a
    second worker would; `join()` returns what it returned, or raises what it raised."""

    def __init__(self, target: Callable[[], Any]) -> None:
        self._target = target
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome["value"] = self._target()
        except BaseException as exc:  # noqa: BLE001 - handed to join()
            self._outcome["error"] = exc
        finally:
            connection.close()

    def join(self, timeout: float = 30) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"the background call did not finish in {timeout}s")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome.get("value")


@contextmanager
def migrated_back_to(targets: list[tuple[str, str]]) -> Iterator[Callable]:
    """The database at `targets` (what depends on later migrations unapplied too) for the
    block, then every app back at its newest migration, whatever happened, for the tests
    that follow. Yields `forward(targets)`, which migrates there and returns those apps."""
    executor = MigrationExecutor(connection)

    def forward(to: list[tuple[str, str]]):
        executor.loader.build_graph()
        executor.migrate(to)
        return executor.loader.project_state(to).apps

    try:
        executor.migrate(targets)
        yield forward
    finally:
        forward(executor.loader.graph.leaf_nodes())


@contextmanager
def triggers_off(model) -> Iterator[None]:
    """PostgreSQL's own triggers on `model`'s table (immutability, lineage) off for what the
    block writes, as a test sets up what the code cannot produce: a past it cannot wait for
    (a call made minutes ago), a row from before a trigger existed, a tampering the code must
    survive. Foreign keys stay checked. ALTER TABLE needs only the table's owner, which the
    test database's user is (no superuser, unlike session_replication_role)."""
    table = connection.ops.quote_name(model._meta.db_table)
    with transaction.atomic(), connection.cursor() as cursor:
        # Django's foreign keys are checked at commit: run those checks now, as ALTER TABLE
        # refuses a table with pending trigger events.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
        yield
        cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")


def updated_past_triggers(rows, **fields: Any) -> int:
    """`rows.update(**fields)` on rows PostgreSQL keeps from rewrites (a call's times, a
    decided approval), past its triggers (see triggers_off)."""
    with triggers_off(rows.model):
        return rows.update(**fields)


@contextmanager
def queries_run() -> Iterator[list[tuple[str, Any]]]:
    """Every SQL statement (and its parameters) the block runs, in order."""
    seen: list[tuple[str, Any]] = []

    def record(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield seen


def a_statement_waits_on_a_lock() -> bool:
    """Whether a session of this test's database waits on a lock. In this database only:
    other test runs (CI's, a developer's) may share the server, and a wait of theirs would
    say ours had begun before it had."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0] > 0


def page_and_query_count(client: Client, url: str) -> tuple[int, str]:
    """GET `url` (it must answer 200): how many queries it ran, and its HTML."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200
    return len(queries), response.content.decode()


def plan_rows_read(sql: str, params: Any, relation: str) -> int:
    """Rows the query's plan, as the planner chooses it, read from `relation` (returned plus
    filtered out): what a page costs, which the rows it shows do not tell."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node: dict) -> int:
        read = 0
        if node.get("Relation Name") == relation:
            read += int((node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                         + node.get("Rows Removed by Index Recheck", 0))
                        * node.get("Actual Loops", 1))
        return read + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan[0]["Plan"])


def browser_sign_in(page, live_server, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")


def luhn_valid(digits: str) -> bool:
    """Whether `digits` pass the Luhn check, computed apart from the code under test: a
    test's "joined, these pass Luhn" holds whatever that code does."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch) * (2 if i % 2 else 1)
        total += n - 9 if n > 9 else n
    return total % 10 == 0


def iban_valid(iban: str) -> bool:
    """Whether `iban` (spaces allowed) passes ISO 13616's mod-97 check."""
    compact = iban.replace(" ", "")
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1
