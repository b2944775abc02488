"""The one table of allowed status transitions. Nothing else decides what may follow what."""

from __future__ import annotations

from operations.models import OperationStatus as S

# What the engine may do on its own: claims, call results, lookups, webhooks.
AUTOMATIC: dict[str, frozenset[str]] = {
    # Unknown from not_started: its authorization ran out after calls were made, and one of
    # them may still land; a lookup must confirm nothing did before it is cancelled.
    S.NOT_STARTED: frozenset({S.IN_PROGRESS, S.CANCELLED, S.UNKNOWN}),
    S.IN_PROGRESS: frozenset({S.ACCEPTED, S.SUCCEEDED, S.FAILED, S.UNKNOWN, S.CANCELLED}),
    S.ACCEPTED: frozenset({S.SUCCEEDED, S.FAILED, S.UNKNOWN}),
    # Back to not_started only when a lookup proved the provider has nothing; cancelled when
    # it proved that after every call could have landed and the authorization has run out.
    S.UNKNOWN: frozenset({S.SUCCEEDED, S.ACCEPTED, S.FAILED, S.NOT_STARTED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.DISPUTED: frozenset(),
}

# What an operator may do, always with a reason and evidence.
MANUAL: dict[str, frozenset[str]] = {
    S.NOT_STARTED: frozenset({S.CANCELLED}),
    S.IN_PROGRESS: frozenset({S.DISPUTED}),  # only once its lease has expired
    S.ACCEPTED: frozenset({S.SUCCEEDED, S.FAILED, S.DISPUTED}),
    S.UNKNOWN: frozenset({S.SUCCEEDED, S.FAILED, S.DISPUTED}),
    S.SUCCEEDED: frozenset({S.DISPUTED}),
    S.FAILED: frozenset({S.DISPUTED}),
    S.DISPUTED: frozenset({S.SUCCEEDED, S.FAILED}),
    # Closed as never done, yet the provider may report an effect after all (a search that
    # trailed further than its usual lag): a person holds it, then resolves it.
    S.CANCELLED: frozenset({S.DISPUTED}),
}

def sources(target: str, *, manual: bool = False) -> frozenset[str]:
    """Every status from which `target` may be reached."""
    table = MANUAL if manual else AUTOMATIC
    return frozenset(src for src, targets in table.items() if target in targets)


def allowed(source: str, target: str, *, manual: bool = False) -> bool:
    return target in (MANUAL if manual else AUTOMATIC).get(source, frozenset())
