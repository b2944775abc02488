"""One HTTP exchange with a provider, and how its failures map onto the engine's outcomes."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from functools import lru_cache
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings
from django.utils import timezone

from operations.providers.base import (
    CallOutcome,
    CallResult,
    LookupMethod,
    LookupOutcome,
    LookupResult,
    request_fingerprint,
)

# A 5xx the provider kept for our key and answers again: a call with that key cannot succeed.
REPLAYED_5XX = "replayed_5xx"
# A lookup that failed on the wire may well work a little later; a person is not needed yet.
# The first wait: the engine stretches it while the lookups keep failing (a backoff).
LOOKUP_RETRY_AFTER = timedelta(seconds=30)
# The longest wait between failing lookups, and the most of a provider's Retry-After that is
# honoured: a provider down for hours is asked a few times an hour, not at its word of a day.
LOOKUP_RETRY_MAX = timedelta(minutes=15)
# A 2xx whose body is not the provider's answer to the request: a proxy's or maintenance page
# (HTML, read as {}), a catch-all stub, an API of another shape. It proves nothing either way.
UNEXPECTED_BODY = "unexpected_body"


# The credentials this console holds for its providers. Any of them in text kept from a
# transport error or a provider's answer is replaced by CREDENTIAL_MARK: that text reaches the
# journal, the audit trail, the operation's page and the command line. httpx refuses a key
# ending in a newline (read from a secret file) with "Illegal header value b'Bearer <key>\\n'".
CREDENTIAL_SETTINGS = (
    "PAYMENTS_API_KEY", "PAYMENTS_WEBHOOK_SECRET",
    "CRM_API_KEY", "CRM_WEBHOOK_SECRET",
    "MAIL_API_KEY", "MAIL_WEBHOOK_SECRET",
)
CREDENTIAL_MARK = "[provider key]"
# Shorter than this a value is no real credential, and marking it would garble the words it
# happens to stand in.
_CREDENTIAL_MIN_LENGTH = 8


def credentials_marked(text: str) -> str:
    """Text from a transport exception or a provider's answer as the journal may keep it: each
    configured credential, as it is or escaped as an exception repeats it, replaced by
    CREDENTIAL_MARK, and any other secret the journal refuses by "[secret]". Text that would
    still hold card data or a secret is not kept at all."""
    # Here, not at the top: settings import the adapters before the models can load.
    from operations.intents.validation import secret_may_be_in, secrets_marked

    forms: set[str] = set()
    for name in CREDENTIAL_SETTINGS:
        # Trimmed: the whitespace around it stays in the text, to say what is wrong with it.
        value = str(getattr(settings, name, "") or "").strip()
        forms |= {value, value.encode("unicode_escape").decode()}
    # The longest first: one key may hold another.
    for form in sorted(forms, key=len, reverse=True):
        if len(form) >= _CREDENTIAL_MIN_LENGTH:
            text = text.replace(form, CREDENTIAL_MARK)
    text = secrets_marked(text, "[secret]")
    if secret_may_be_in(text):
        return "[not kept: the text looked like card data or a secret]"
    return text


def _marked(value: Any) -> Any:
    """A provider's error object with credentials_marked applied to every string in it."""
    if isinstance(value, str):
        return credentials_marked(value)
    if isinstance(value, dict):
        return {key: _marked(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [_marked(inner) for inner in value]
    return value


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer at all
    body: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    transport_error: str = ""  # "timeout" | "connection"
    message: str = ""
    # The provider answered with what it kept for our Idempotency-Key, not by running the
    # request again (Stripe's `Idempotent-Replayed: true`).
    replayed: bool = False
    # How long the provider asked us to wait (its Retry-After), at most LOOKUP_RETRY_MAX.
    retry_after: timedelta | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def error(self) -> dict[str, Any]:
        error = self.body.get("error")
        return error if isinstance(error, dict) else {}


_client: httpx.Client | None = None
_client_pid = 0
_client_lock = threading.Lock()


def _shared_client() -> httpx.Client:
    """One pooled client per process (thread-safe). Building one loads the CA bundle, about
    40 ms, which per call would dominate the cost of an effect; after a fork (Celery's
    prefork pool) the child builds its own so no socket is shared across processes."""
    global _client, _client_pid
    pid = os.getpid()
    if _client is None or _client_pid != pid:
        with _client_lock:
            if _client is None or _client_pid != pid:
                _client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=8))
                _client_pid = pid
    return _client


def shared_client_close() -> None:
    """Close this process's pooled connections (a test's live server then sees them end)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None


# When the call this thread is making must no longer be sent: the end of the worker's lease.
# A worker that stalled past it (a long GC pause, a frozen container) may have been presumed
# dead, and a lookup may already have proven the effect absent; sent now, the request would
# land where nobody looks for it. The engine sets it around each call.
send_deadline: ContextVar[datetime | None] = ContextVar("send_deadline", default=None)


class LeaseLost(Exception):
    """The lease ran out before the request went out: nothing was sent."""


def send_timeout(seconds: float) -> httpx.Timeout:
    """The client's timeouts for an exchange allowed `seconds`: the request is out, or given
    up, within `seconds` of the call, which the engine counts on to know until when a call
    whose answer never came may still reach the provider (`call_reach_until`). httpx applies
    one figure to each phase on its own, so `seconds` alone would let a request leave as late
    as four times it: waiting for a pooled connection, connecting, and writing the headers
    and then the body (ours fit in one write each) share it. Reading the answer may take all
    of it."""
    share = seconds / 4
    return httpx.Timeout(seconds, pool=share, connect=share, write=share)


def send(
    method: str,
    url: str,
    *,
    api_key: str,
    headers: dict[str, str] | None = None,
    data: dict[str, str] | None = None,
    json: dict[str, Any] | None = None,
    params: dict[str, str] | None = None,
) -> Answer:
    deadline = send_deadline.get()
    if deadline is not None and timezone.now() >= deadline:
        raise LeaseLost(f"the lease ran out at {deadline:%H:%M:%S}; {method} not sent")
    all_headers = {"Authorization": f"Bearer {api_key}", **(headers or {})}
    # Read at call time so a settings override (tests, an operator's env change) takes effect.
    timeout = send_timeout(float(settings.PROVIDER_TIMEOUT_SECONDS))
    try:
        response = _shared_client().request(
            method, url, headers=all_headers, data=data, json=json, params=params,
            timeout=timeout,
        )
    except httpx.TimeoutException as exc:
        return Answer(None, transport_error="timeout",
                      message=credentials_marked(str(exc)) or "timed out")
    except httpx.TransportError as exc:
        return Answer(None, transport_error="connection",
                      message=credentials_marked(str(exc)) or type(exc).__name__)
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {"data": body}
    if isinstance(body.get("error"), dict):
        # What a failure keeps of the answer (its message, the error whole) comes from here.
        body["error"] = _marked(body["error"])
    return Answer(
        response.status_code, body, response.headers.get("Request-Id", ""),
        replayed=response.headers.get("Idempotent-Replayed", "").lower() == "true",
        retry_after=retry_after_read(response.headers.get("Retry-After", "")),
    )


def retry_after_read(value: str) -> timedelta | None:
    """A Retry-After header (seconds, or an HTTP date), at most LOOKUP_RETRY_MAX; None when
    there is none or it is not readable."""
    value = value.strip()
    if value.isdigit():
        return min(timedelta(seconds=min(int(value), 10**9)), LOOKUP_RETRY_MAX)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # an HTTP date is always GMT
    return min(max(when - timezone.now(), timedelta(0)), LOOKUP_RETRY_MAX)


def path_segment(value: str) -> str:
    """An id as exactly one segment of a URL path: a person may have typed it."""
    return quote(value, safe="")


def call_result(
    answer: Answer,
    *,
    sent: Mapping[str, Any],
    outcome: Callable[[dict[str, Any]], CallOutcome],
    facts: Callable[[Mapping[str, Any]], dict[str, Any]],
    lacks: Callable[[Mapping[str, Any]], str],
) -> CallResult:
    """The CallResult of one create/update: on a 2xx, `outcome` and `facts` read the body;
    otherwise `call_failure` decides. A version conflict carries what the record is now, so a
    person can decide; it is never retried with fresh data.

    `lacks` says what a 2xx body lacks to be the provider's answer to this call ("" when
    nothing): the object the call made or changed, carrying this operation. Anything at the
    provider's address can answer 200; taken for success, it would close the operation for
    good on an effect nobody made. Without it the call is unknown, and a lookup finds out."""
    common: dict[str, Any] = {
        "request_hash": request_fingerprint(sent),
        "provider_request_id": answer.request_id,
        "http_status": answer.status,
    }
    missing = lacks(answer.body) if answer.ok else ""
    if missing:
        return CallResult(
            outcome=CallOutcome.UNKNOWN, error_class=UNEXPECTED_BODY,
            error_message=f"the provider answered {answer.status} without {missing}", **common,
        )
    if answer.ok:
        return CallResult(
            outcome=outcome(answer.body), external_id=str(answer.body.get("id", "")),
            result=facts(answer.body), **common,
        )
    failed, error_class, message = call_failure(answer)
    result: dict[str, Any] = {}
    if failed is CallOutcome.CONFLICT:
        result = {
            "current_version": answer.error.get("current_version"),
            "current": answer.error.get("current") or {},
        }
    elif answer.error:
        result = {"error": answer.error}
    return CallResult(
        outcome=failed, error_class=error_class, error_message=message, result=result, **common
    )


# A call answered so (refused at the door, or by something that is not the provider's API)
# reached no provider account where it could act: a later lookup in another account (the key
# or the base put right) is not asked about it.
REACHED_NO_ACCOUNT = frozenset({"not_authorized", "http_4xx"})


def provider_refusal(answer: Answer) -> bool:
    """Whether a 4xx is the provider's own refusal: an error body in its shape (Stripe's, which
    the CRM and mail contracts share: `{"error": {"type", "code", "message"}}`). A 404 needs
    its code too: the provider answers a path it does not know (an API base ending in /v1)
    with a 404 naming its type and no code, which refuses no intent."""
    error = answer.error
    if not isinstance(error.get("type"), str) or not error["type"]:
        return False
    return answer.status != 404 or bool(error.get("code"))


def call_failure(answer: Answer) -> tuple[CallOutcome, str, str]:
    """(outcome, error_class, message) of an answer that is not a 2xx."""
    error = answer.error
    message = str(error.get("message") or answer.message or f"HTTP {answer.status}")
    if answer.status is None:
        return CallOutcome.UNKNOWN, answer.transport_error, message
    if answer.status >= 500:
        if answer.replayed:
            # Stripe keeps the answer of a request that began to run, a 500 included, and
            # gives it to every retry with that key for as long as it keeps the key.
            return CallOutcome.UNKNOWN, REPLAYED_5XX, f"replayed for this key: {message}"
        return CallOutcome.UNKNOWN, "http_5xx", message
    if answer.status == 409:
        if error.get("code") == "version_conflict":
            return CallOutcome.CONFLICT, "version_conflict", message
        if error.get("code") == "resource_already_exists":
            # A unique field refused a second create: an earlier call of ours (one that timed
            # out) may have landed. The lookup that follows unknown finds out whose it is.
            return CallOutcome.UNKNOWN, "already_exists", message
        # Another request with our key is still running: its effect may or may not land.
        return CallOutcome.UNKNOWN, "concurrent_request", message
    if error.get("type") == "idempotency_error":
        # Our key already names a request with other parameters: a person must look. By the
        # type, not only on a 400: Stripe's own client reads it on a 404 too.
        return CallOutcome.UNKNOWN, "idempotency_error", message
    if answer.status == 429 or (answer.status == 400 and error.get("code") == "rate_limit"):
        # Rate limited: the provider did nothing, which a lookup will prove before a retry.
        # (Stripe coded a rate limit as a 400 with code rate_limit before it used 429; its
        # own client still reads both.)
        return CallOutcome.UNKNOWN, "rate_limited", message
    if answer.status == 424:
        # Stripe: "a failure in a dependency external to Stripe" (a bank, a card network),
        # which says nothing of how far the request got: a lookup finds out.
        return CallOutcome.UNKNOWN, "external_dependency", message
    if answer.status in (401, 403):
        # The key was refused, or may not do this: the request got no further than the door.
        # That says nothing of the intent (a key set wrong, rotated, or restricted), so a
        # lookup decides, and the limit on automatic calls hands it to a person if it lasts.
        return CallOutcome.UNKNOWN, "not_authorized", message
    if 400 <= answer.status < 500:
        if provider_refusal(answer):
            return CallOutcome.FAILED, "validation", message
        # Not the provider's word on the intent: whatever answered (a proxy, a path one
        # segment off) may never have passed the request on. Closed as failed, an approved
        # intent nobody refused could only be undone by a new intent and a new approval.
        return CallOutcome.UNKNOWN, "http_4xx", message
    # A redirect or other surprise: we cannot tell what happened.
    return CallOutcome.UNKNOWN, "unexpected_status", message


def lookup_common(answer: Answer, *, method: Any) -> dict[str, Any]:
    """What every LookupResult records of the answer it came from."""
    return {"method": method, "http_status": answer.status,
            "provider_request_id": answer.request_id}


def lookup_failure(answer: Answer, *, method: Any) -> LookupResult:
    _, error_class, message = call_failure(answer)
    return LookupResult(
        outcome=LookupOutcome.INCONCLUSIVE,
        reason=f"lookup failed ({error_class}): {message}",
        # A rate limit or maintenance that says how long it lasts is not asked sooner.
        retry_after=max(LOOKUP_RETRY_AFTER, answer.retry_after or LOOKUP_RETRY_AFTER),
        backoff=True,
        **lookup_common(answer, method=method),
    )


def unexpected_answer(answer: Answer, *, method: Any, missing: str) -> LookupResult:
    """A lookup answered 2xx without what was asked (`missing`): nothing is proven, absence
    least of all; asked again later, the provider itself may answer."""
    return LookupResult(
        outcome=LookupOutcome.INCONCLUSIVE, retry_after=LOOKUP_RETRY_AFTER, backoff=True,
        reason=f"the provider answered {answer.status} without {missing} (is the API base "
        "right?)",
        **lookup_common(answer, method=method),
    )


def listed(
    answer: Answer, *, method: Any, what: str, belongs: Callable[[Mapping[str, Any]], bool],
    list_object: str = "",
) -> tuple[list[dict[str, Any]], LookupResult | None]:
    """The objects of a 2xx list answer (`data`, and Stripe's `object` when `list_object`
    names it), each of which must be one asked for (`belongs`); else an inconclusive
    lookup. An empty list proves absence only when it is the provider's: a page that is
    not (HTML, read as {}) has no `data`, and a provider that ignored the filter lists
    others' objects, which are no match of ours either."""
    data = answer.body.get("data")
    if (list_object and answer.body.get("object") != list_object) or not isinstance(data, list):
        return [], unexpected_answer(answer, method=method, missing=f"its list of {what}")
    if not all(isinstance(item, dict) for item in data):
        return [], unexpected_answer(answer, method=method, missing=f"a list of {what} objects")
    if not all(belongs(item) for item in data):
        return [], unexpected_answer(
            answer, method=method, missing=f"a list of only the {what} asked for")
    return data, None


def lookup_by_id(
    url: str, *, object_id: str, api_key: str, what: str,
    found: Callable[[Mapping[str, Any]], dict[str, Any]], headers: dict[str, str] | None = None,
) -> LookupResult:
    """GET one object by the provider's own id: absent on a 404 that says the object is
    missing (a provider never reuses an id it gave, so "no such object" is a proof),
    inconclusive when it could not be asked or the 2xx is not that object, else FOUND with
    what `found` reads of the object (status, external_id, facts, the operation ids it
    carries)."""
    method = LookupMethod.EXTERNAL_ID
    answer = send("GET", url, api_key=api_key, headers=headers)
    common = lookup_common(answer, method=method)
    if answer.status == 404 and answer.error.get("code") == "resource_missing":
        return LookupResult(outcome=LookupOutcome.ABSENT, reason=f"{what} does not exist",
                            **common)
    if answer.status == 404:
        # Stripe answers a path it does not know (an API base ending in /v1, a proxy's own
        # page) with a 404 too, with no code: that says nothing of the object.
        return LookupResult(
            outcome=LookupOutcome.INCONCLUSIVE, retry_after=LOOKUP_RETRY_AFTER, backoff=True,
            reason="the provider answered 404 without saying the object is missing "
            f"(is the API base right?): {answer.error.get('message') or answer.message}",
            **common,
        )
    if not answer.ok:
        return lookup_failure(answer, method=method)
    if answer.body.get("id") != object_id:
        return unexpected_answer(answer, method=method, missing=what)
    return LookupResult(outcome=LookupOutcome.FOUND, **found(answer.body), **common)


def absence_once_named(found: LookupResult, *, external_id: str) -> LookupResult:
    """What "no such object" proves once the provider has named its object for this
    operation (`external_id`): nothing. The object existed, so it was deleted since, or the
    key now reaches another account or mode (Stripe answers 404 for both; a mail provider
    forgets old messages). A call on that absence would make a second effect wherever the
    key or the natural key no longer dedups it: a person decides."""
    if found.outcome != LookupOutcome.ABSENT or not external_id:
        return found
    return replace(
        found, outcome=LookupOutcome.INCONCLUSIVE, retry_after=None,
        reason=f"the provider no longer has {external_id}, which it named for this operation "
        "(deleted since, or asked of another account or mode)",
    )


@lru_cache(maxsize=32)
def account_fingerprint(base: str, api_key: str) -> str:
    """Which provider account a request reaches, as the journal may keep it: the endpoint
    and the API key (Stripe's key alone picks the account and live or test mode), hashed,
    never the key itself. Equal fingerprints: the same account. Different: possibly another
    one, where a lookup cannot see what a call made."""
    digest = hashlib.sha256(f"{base.rstrip('/')}\n{api_key}".encode()).hexdigest()
    return f"acct_{digest[:12]}"


def carried_ids(*ids: Any) -> tuple[str, ...]:
    """The operation ids an object names, without the empty ones."""
    return tuple(str(op_id) for op_id in ids if op_id)
