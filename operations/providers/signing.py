"""Webhook signatures, shared by the verifiers and by the sandbox that signs what it sends."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from operations.providers.base import WebhookSignatureError

# Stripe's default: a signed timestamp older than this is refused, so a captured request
# cannot be replayed later.
STRIPE_TOLERANCE_SECONDS = 300
# The widths of WebhookEvent's event_id/external_id and event_type columns: a longer value
# would fail the INSERT (a 500, which the provider retries for days) instead of a 400.
EVENT_ID_MAX = 120
EVENT_TYPE_MAX = 80
# How deep a signed body may nest. Refused past it (a 400), not when the parser gives up:
# json.loads reads ~1000 levels, json.dumps of the stored facts recurses deeper in the stack
# and overflows it a little below that (a RecursionError, a 500), and where depends on the
# stack the request runs on. The providers' events nest about 6 levels.
EVENT_DEPTH_MAX = 64


def _hmac_hex(secret: str, payload: bytes) -> str:
    return hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


def header_get(headers: Mapping[str, str], name: str) -> str:
    # Callers pass Django's case-insensitive request.headers or a plain dict.
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return ""


def stripe_signature_header(*, secret: str, body: bytes, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={_hmac_hex(secret, f'{t}.'.encode() + body)}"


def stripe_signature_verify(
    *,
    secret: str,
    header: str,
    body: bytes,
    tolerance: int = STRIPE_TOLERANCE_SECONDS,
    now: float | None = None,
) -> int:
    """Verify as Stripe's libraries do; returns the signed timestamp."""
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "t":
            try:
                timestamp = int(value)
            except ValueError:
                raise WebhookSignatureError("signature timestamp is not a number") from None
        elif name == "v1":
            signatures.append(value)
    if timestamp is None or not signatures:
        raise WebhookSignatureError("no timestamp or no v1 signature in Stripe-Signature")
    expected = _hmac_hex(secret, f"{timestamp}.".encode() + body)
    # Compare every candidate without stopping early, so timing says nothing about which failed.
    matched = False
    for candidate in signatures:
        matched |= digests_equal(expected, candidate)
    if not matched:
        raise WebhookSignatureError("no signature matches the body")
    current = time.time() if now is None else now
    if tolerance and timestamp < current - tolerance:
        raise WebhookSignatureError("signature timestamp is outside the tolerance")
    return timestamp


def digests_equal(expected: str, given: str) -> bool:
    """Constant-time comparison of a header value we did not write. As bytes: compare_digest
    refuses a str holding anything but ASCII (TypeError, a 500), and a header can hold any
    Latin-1 character."""
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def hmac_signature_header(*, secret: str, body: bytes) -> str:
    return f"sha256={_hmac_hex(secret, body)}"


def hmac_signature_verify(*, secret: str, header: str, body: bytes) -> None:
    scheme, _, value = header.strip().partition("=")
    if scheme != "sha256" or not value:
        raise WebhookSignatureError("signature header is not of the form sha256=<hex>")
    if not digests_equal(_hmac_hex(secret, body), value):
        raise WebhookSignatureError("signature does not match the body")


@dataclass(frozen=True)
class SignedEvent:
    id: str
    type: str
    object: dict[str, Any]
    object_id: str
    created_at: datetime | None
    body: dict[str, Any]


def _constant_refused(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e400 reads as inf, which jsonb refuses
        raise ValueError(f"{text} is out of range")
    return number


def _storable(value: Any) -> bool:
    """Whether PostgreSQL takes every string in it (in text and jsonb): no NUL, and no lone
    surrogate ("\\ud800", which json.loads lets through and UTF-8 cannot encode). Walked
    without recursion: the body's nesting is the sender's choice."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return False
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Walked without recursion, like `_storable`."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


def event_operation_id(value: Any, *, what: str) -> str:
    """The operation id a signed event's object carries. Ours, and optional (an object made
    outside the console carries none): absent or null, a field left unset, names none, never
    the operation "None". Any other non-text is not the provider's shape: refused (400)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebhookSignatureError(f"signed {what} event has an operation id that is not text")
    return value


def signed_event_parse(body: bytes, *, what: str) -> SignedEvent:
    """The common envelope `{"id", "type", "created", "data": {"object": …}}` of a body whose
    signature was already verified. Signed but malformed is refused like a bad signature:
    it is not ours to interpret. So is one the journal could not store (NaN, a NUL, nesting
    deeper than `EVENT_DEPTH_MAX`): answered 400, not 500, which a provider retries for days."""
    try:
        event = json.loads(body, parse_constant=_constant_refused, parse_float=_finite_float)
        obj = event["data"]["object"]
        event_id = event["id"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise WebhookSignatureError(f"signed body is not a {what} event") from None
    if not _storable(event):
        raise WebhookSignatureError(f"signed {what} event holds text no database can store")
    if nested_deeper_than(event, EVENT_DEPTH_MAX):
        raise WebhookSignatureError(
            f"signed {what} event nests deeper than {EVENT_DEPTH_MAX} levels"
        )
    if not isinstance(obj, dict):
        raise WebhookSignatureError(f"signed body is not a {what} event")
    # The id is what deduplicates: a null or empty one, stored once, would make every later
    # id-less event its "duplicate", answered 200 and never applied.
    if not isinstance(event_id, str) or not event_id.strip() or len(event_id) > EVENT_ID_MAX:
        raise WebhookSignatureError(f"signed {what} event has no usable id")
    # The object's id is how the engine tells the operation's object from a second one
    # carrying its id, and every object of these providers has one: a null read as the
    # object "None", or an event naming no object that settled an operation, would let the
    # next payment reported for it pass for its own.
    object_id = obj.get("id")
    if not isinstance(object_id, str) or not object_id.strip():
        raise WebhookSignatureError(f"signed {what} event names no object id")
    if len(str(event.get("type", ""))) > EVENT_TYPE_MAX or len(object_id) > EVENT_ID_MAX:
        raise WebhookSignatureError(f"signed {what} event has a type or object id too long")
    created = event.get("created")
    try:
        created_at = None if created is None else datetime.fromtimestamp(int(created), tz=UTC)
    except (ValueError, TypeError, OverflowError, OSError):
        # Answered 400, not 500: a provider retries a 5xx for days.
        raise WebhookSignatureError(f"signed {what} event has no valid 'created' time") from None
    return SignedEvent(
        id=event_id,
        type=str(event.get("type", "")),
        object=obj,
        object_id=object_id,
        created_at=created_at,
        body=event,
    )
