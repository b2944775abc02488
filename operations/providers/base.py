"""What the engine knows about a provider: its declared contract and its verbs (call, look up
an operation's effect, retrieve an object by id, read a webhook).

The engine never asks "is this provider idempotent?" of a global flag; it reads the adapter's
`ToolContract`. Adapters do real HTTP and return normalized results; they never touch the
database (the engine records everything, in its own short transactions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import urlsplit


class EffectClass(StrEnum):
    READ = "read"
    CREATE_WITH_NATURAL_KEY = "create_with_natural_key"
    VERSIONED_UPDATE = "versioned_update"
    IRREVERSIBLE = "irreversible"


class LookupMethod(StrEnum):
    EXTERNAL_ID = "external_id"
    IDEMPOTENCY_KEY = "idempotency_key"
    UNIQUE_FIELD = "unique_field"


@dataclass(frozen=True)
class ToolContract:
    provider: str
    effect_class: EffectClass
    synchronous: bool
    lookup_methods: tuple[LookupMethod, ...]
    # How long the provider remembers an idempotency key; None: it takes no keys.
    key_retention: timedelta | None
    # Re-sending with the same key can never make a second effect (inside key_retention).
    same_key_retry_safe: bool
    # An empty search younger than this after the last call is not proof of absence.
    search_lag: timedelta = timedelta(0)
    # How far the search may trail writes at worst, in a provider's incident. An empty search
    # may still let a same-key call follow after search_lag (the key dedups a repeat), but
    # closing an operation as never done is for good: the failed or cancelled intent may be
    # replaced by one with a new key. So no operation is closed on a search younger than this.
    search_lag_outage: timedelta = timedelta(0)
    dedup_method: str = ""
    # How long after our client gave up on a call (a timeout, a lost connection, a gateway
    # error) the provider may still carry it out. Until then no lookup may close the
    # operation as never done.
    late_landing: timedelta = timedelta(seconds=60)

    @property
    def search_lag_closing(self) -> timedelta:
        """How old an empty search must be to close an operation as never done."""
        return max(self.search_lag, self.search_lag_outage)

    @property
    def autonomous(self) -> bool:
        """Without a lookup and without idempotent create, unknowns always go to a person."""
        return bool(self.lookup_methods) or self.same_key_retry_safe

    def facts(self) -> list[tuple[str, str]]:
        """The contract as an operator reads it before settling an unknown outcome by hand:
        how the provider tells a repeat from a new effect, how to find what it did, and for
        how long a same-key retry stays safe."""
        facts = [
            ("Provider", self.provider),
            ("Effect", _EFFECT_WORDS[self.effect_class]),
            ("Final result", "in the answer to the call" if self.synchronous
             else "may come later, by webhook or lookup"),
            ("Deduplication", self.dedup_method or "none"),
            ("Looked up by", ", ".join(_LOOKUP_WORDS[m] for m in self.lookup_methods)
             or "no lookup: unknown outcomes go to a person"),
            ("Keys kept", f"{_duration_words(self.key_retention)} from first use"
             if self.key_retention else "takes no idempotency key"),
            ("Same-key retry", "safe: a repeat cannot make a second effect"
             if self.same_key_retry_safe else "not safe: never sent again without a lookup"),
        ]
        if self.search_lag:
            facts.append(("Search lag", f"up to {_duration_words(self.search_lag)}: an empty "
                          "search younger than that proves nothing"))
        if self.search_lag_outage > self.search_lag:
            facts.append(("Search lag in an outage", f"up to "
                          f"{_duration_words(self.search_lag_outage)}: no operation is closed "
                          "as never done on an empty search younger than that"))
        return facts


_EFFECT_WORDS = {
    EffectClass.READ: "read only",
    EffectClass.CREATE_WITH_NATURAL_KEY: "creates a record with a unique field",
    EffectClass.VERSIONED_UPDATE: "changes a record at an expected version",
    EffectClass.IRREVERSIBLE: "irreversible",
}
_LOOKUP_WORDS = {
    LookupMethod.EXTERNAL_ID: "the provider's id",
    LookupMethod.IDEMPOTENCY_KEY: "the idempotency key",
    LookupMethod.UNIQUE_FIELD: "the operation id stored with the effect",
}


def _duration_words(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    # Days from two on: providers state a day's retention as "24 hours".
    for unit, size, least in (("day", 86400, 2), ("hour", 3600, 1), ("minute", 60, 1)):
        if seconds >= size * least and seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} s"


class CallOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    ACCEPTED = "accepted"  # taken by the provider, final result later (webhook / lookup)
    FAILED = "failed"  # a definitive rejection (4xx validation): the intent cannot run
    CONFLICT = "conflict"  # versioned update refused: the record changed since the intent
    UNKNOWN = "unknown"  # timeout, connection lost, 5xx, concurrent same-key request


class LookupOutcome(StrEnum):
    FOUND = "found"  # exactly one effect: `status` says which
    ABSENT = "absent"  # proven: the provider has no effect for this operation
    INCONCLUSIVE = "inconclusive"  # lookup failed, several matches, or search lag


@dataclass(frozen=True)
class OperationSnapshot:
    """What an adapter may know of an operation. Built by the engine from the journal."""

    id: str
    action: str
    tenant: str
    payload: Mapping[str, Any]
    idempotency_key: str
    external_id: str = ""
    # The newest call's answer, or the last moment it could still reach the provider.
    last_call_at: datetime | None = None
    # When the first call with `idempotency_key` was sent: a provider forgets a key a set
    # time (the contract's key_retention) after it first saw it, whatever came after.
    key_first_sent_at: datetime | None = None
    # The provider accounts (`ProviderAdapter.account`) this operation's calls went to.
    call_accounts: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CallResult:
    outcome: CallOutcome
    external_id: str = ""
    provider_request_id: str = ""
    http_status: int | None = None
    result: dict[str, Any] = field(default_factory=dict)
    error_class: str = ""
    error_message: str = ""
    request_hash: str = ""


@dataclass(frozen=True)
class LookupResult:
    outcome: LookupOutcome
    method: LookupMethod | None = None
    status: CallOutcome | None = None  # of the one match, when FOUND
    external_id: str = ""
    matches: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    # An inconclusive lookup that may succeed later (search lag, a 5xx): when to try again.
    retry_after: timedelta | None = None
    # The provider could not be asked, or did not answer what was asked (a 5xx, a rate limit,
    # a timeout, a page that is not its answer): such a failure may last (an outage, a wrong
    # API base), so the engine waits longer each time it repeats, from `retry_after` on. A
    # search's lag ends when it ends: that retry is not stretched.
    backoff: bool = False
    http_status: int | None = None
    provider_request_id: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    # The operation ids the found object names as its origin (a payment's metadata, a deal's
    # agent_operation_id or the updates it applied, a message's operation_id): what ties an
    # id a person typed to one operation.
    operation_ids: tuple[str, ...] = ()
    # Pending, and only someone the console cannot reach moves it on (a customer's 3-D
    # Secure): who and why. Looking again will not settle it; a person decides.
    waits_on: str = ""


@dataclass(frozen=True)
class WebhookFacts:
    event_id: str
    event_type: str
    operation_id: str = ""
    external_id: str = ""
    status: CallOutcome | None = None
    created_at: datetime | None = None
    data: dict[str, Any] = field(default_factory=dict)
    # Whether the event's object is one operation's alone, so an event naming no operation
    # of ours may be linked by it (a payment, a message). A CRM deal is not: its create and
    # every update of it carry its id, and a change someone made in the CRM is none of them.
    linked_by_object: bool = True


class WebhookSignatureError(Exception):
    """The body was not signed by the provider (or the signature is too old)."""


def sandbox_endpoint(base: str) -> bool:
    """This console's own sandbox: /sandbox/ on loopback (of whatever port it runs on)."""
    parts = urlsplit(base)
    return parts.hostname in {"127.0.0.1", "localhost", "::1"} and parts.path.startswith(
        "/sandbox/"
    )


class ProviderAdapter(Protocol):
    contract: ToolContract

    def endpoint(self) -> str:
        """The base URL requests go to now."""
        ...

    def account(self) -> str:
        """The fingerprint of the provider account requests go to now (`transport.
        account_fingerprint` of the configured endpoint and key)."""
        ...

    def call(self, op: OperationSnapshot) -> CallResult: ...

    def lookup(self, op: OperationSnapshot) -> LookupResult: ...

    def retrieve(self, external_id: str) -> LookupResult:
        """The one object with this provider id: FOUND, ABSENT (no such object) or
        INCONCLUSIVE (the provider could not be asked)."""
        ...

    def intent_problem(self, payload: Mapping[str, Any]) -> str:
        """Why a valid intent still cannot be sent to this provider as it is (an amount its
        API has no unit for); empty when it can. Asked when the intent is prepared, before
        anyone approves what could never be carried out."""
        ...

    def disagreement(self, *, payload: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
        """Why an object the provider reports for this operation (found, named by a webhook,
        or given as a reference) is not the effect its intent describes; empty when nothing
        it reports contradicts the intent."""
        ...


class WebhookVerifier(Protocol):
    def parse_webhook(self, *, headers: Mapping[str, str], body: bytes) -> WebhookFacts: ...


def request_fingerprint(params: Mapping[str, Any]) -> str:
    """sha256 of the parameters sent, to prove that a retry sent exactly the same thing."""
    blob = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()
