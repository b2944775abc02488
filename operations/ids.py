"""Prefixed, time-sortable ids: `op_01J…`, `run_01J…`. A person can tell what an id names."""

from __future__ import annotations

from ulid import ULID

PREFIXES = frozenset({"conv", "run", "cp", "cmd", "op", "apr", "evt"})


def new_id(prefix: str) -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}")
    return f"{prefix}_{ULID()}"
