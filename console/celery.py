"""The Celery app. Settings come from Django's settings under the CELERY_ namespace."""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from celery.signals import task_postrun, task_prerun

from console.env import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def broker_connection_check(*, timeout: float) -> None:
    """Connect to the broker once, within `timeout`; raises when it cannot be reached. One
    attempt: kombu's default retries would take far longer than any probe waits."""
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout)


@app.on_configure.connect
def _settings_first(sender, **kwargs) -> None:
    """The worker and beat read the settings first here: a bad value is one line, not a
    traceback. Not at import: `make run` and `make test` import this package before the
    embedded servers they start exist."""
    settings_load_or_exit()


@app.on_after_configure.connect
def _beat_schedule_folder(sender, **kwargs) -> None:
    """beat keeps its schedule in a file whose folder (var/ by default) a fresh deployment
    does not have; shelve would not create it."""
    try:
        Path(sender.conf.beat_schedule_filename).parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # read-only: beat then names the file it cannot open


@task_prerun.connect
@task_postrun.connect
def _recycle_database_connections(sender=None, **kwargs) -> None:
    """Django's request rule around every task: keep a healthy connection (CONN_MAX_AGE),
    drop one that is obsolete, broken or left inside a transaction. Not for eager calls,
    which run inside the caller's connection and transaction (as Celery's fixup skips them)."""
    if sender is None or getattr(sender.request, "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()
