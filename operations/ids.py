"""Prefixed, time-sortable ids: `op_01J…`, `run_01J…`. A person can tell what an id names."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from django.urls.converters import StringConverter
from ulid import ULID

PREFIXES = frozenset({"conv", "run", "cp", "cmd", "op", "apr", "evt"})

_lock = threading.Lock()
_last = 0


def _monotonic_ulid() -> ULID:
    """A ULID that sorts after every earlier one made by this process, even within one
    millisecond (plain ULIDs are random there), so ids made in sequence keep their order."""
    global _last
    with _lock:
        candidate = int(ULID())
        if candidate >> 80 <= _last >> 80 and _last:
            candidate = _last + 1
        _last = candidate
    return ULID.from_int(candidate)


def new_id(prefix: str) -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}")
    return f"{prefix}_{_monotonic_ulid()}"


def id_after(prefix: str, moment: datetime) -> str:
    """The lowest id of `prefix` that sorts after every id made up to `moment`: the first of
    the next millisecond, as an id made within `moment`'s own millisecond may still be
    earlier than it."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}")
    millisecond = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    return f"{prefix}_{ULID.from_int((millisecond + 1) << 80)}"


class PathIdConverter(StringConverter):
    """An id in a URL: what `str` takes, but never a NUL byte (PostgreSQL refuses one in a
    text value, so a crafted /operations/%00/ would answer 500, not 404) and never longer
    than an id column holds."""

    regex = r"[^/\x00]{1,40}"
