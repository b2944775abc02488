from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_safe

from approvals.selectors import approvals_waiting
from console.celery import broker_connection_check
from console.forms import AuditFilterForm
from console.middleware import action_page
from operations.htmx import page_render
from operations.intents import mask_person_text, payload_hashes_fingerprinted
from operations.selectors import (
    audit_action_names,
    audit_events_for_user,
    dashboard_metrics,
    keyset_page,
    tenants_for_user,
)
from operations.services import audit_trail_export_record

AUDIT_PAGE_SIZE = 50


@dataclass(frozen=True)
class AuditChange:
    field: str
    before: str | None  # None: the field is not in "before"
    after: str | None  # None: the field is not in "after"


def _audit_value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return ", ".join(value) or "—"
    return _audit_json(value)


def _audit_json(value: Any) -> str:
    """A nested before/after value as text, masked, for the page and the export alike. Each
    string is masked before the value is written as JSON: written first, its escapes hide
    what they stand next to (a phone number typed on a new line follows "\\n", and the "n"
    joins it to a word), and "\\u043f…" is no address a mask can find (anna@почта.рф)."""
    return json.dumps(_masked(value), sort_keys=True, ensure_ascii=False)


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return mask_person_text(value)
    if isinstance(value, list):
        return [_masked(inner) for inner in value]
    if isinstance(value, dict):
        # A key can hold what a value can (an address, a phone number).
        return {mask_person_text(key): _masked(inner) for key, inner in value.items()}
    if isinstance(value, int) and not isinstance(value, bool):
        # An account or phone number stored as a JSON number is still one.
        shown = mask_person_text(str(value))
        return value if shown == str(value) else shown
    return value


def audit_changes(before: Any, after: Any) -> list[AuditChange]:
    """An event's before/after as a person reads it: one line per field, old → new where
    it changed (the CSV export keeps the stored JSON, masked as the page is). An intent's
    hash is shown as its keyed fingerprint on both: the trail is read beside the masked
    intent, which the hash itself would give back whole."""

    def fields(side: Any) -> dict[str, Any]:
        if side is None:
            return {}
        return side if isinstance(side, dict) else {"value": side}

    old = fields(payload_hashes_fingerprinted(before))
    new = fields(payload_hashes_fingerprinted(after))
    changes = []
    for name in [*old, *(name for name in new if name not in old)]:
        was = _audit_value(old[name]) if name in old else None
        now = _audit_value(new[name]) if name in new else None
        # Compared as stored too: a nested value is shown masked, and two accounts masked
        # alike ("••••4312") are still a change.
        if was is not None and was == now and old[name] == new[name]:
            was = None  # unchanged: shown once
        changes.append(AuditChange(field=name, before=was, after=now))
    return changes


def _database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone() == (1,)
    except Exception:  # noqa: BLE001 - any failure means "down"
        connection.close_if_unusable_or_obsolete()
        return False


def _broker_ok() -> bool:
    try:
        broker_connection_check(timeout=2)
        return True
    except Exception:  # noqa: BLE001
        return False


@login_not_required
@never_cache
# HEAD too: many uptime monitors probe with it, and a 405 would report the console down.
@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _database_ok(), "broker": _broker_ok()}
    body = {name: "ok" if ok else "down" for name, ok in checks.items()}
    body["status"] = "ok" if all(checks.values()) else "down"
    return JsonResponse(body, status=200 if all(checks.values()) else 503)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """A POST from a page loaded before the person last signed in (signing in renews the
    token, in every tab) or whose cookie is gone. Django's own page says "CSRF verification
    failed", which tells an approver nothing about whether the payment was approved."""
    back = request.headers.get("Referer", "")
    if not url_has_allowed_host_and_scheme(
        back, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        back = ""
    # A refused form is rendered at its action's URL, whose GET would be a blank 405.
    back = back and (action_page(back) or back)
    return render(request, "csrf_failure.html", {"back": back}, status=403)


@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    tenants = tenants_for_user(request.user)
    metrics = dashboard_metrics(request.user)
    return render(
        request, "console/dashboard.html",
        {"tenants": tenants, "metrics": metrics, "waiting": approvals_waiting(request.user),
         "window_label": f"last {metrics['window'].days} days"},
    )


@require_GET
def audit_list(request: HttpRequest) -> HttpResponse:
    if not tenants_for_user(request.user, "view_audit").exists():
        # An empty trail would read as "nothing happened"; the page is not theirs to read.
        raise PermissionDenied("the audit trail needs the auditor or admin role")
    form = AuditFilterForm(request.GET)
    if form.is_valid():
        events, next_cursor = keyset_page(
            audit_events_for_user(request.user, filters=form.filters()),
            before=form.cleaned_data.get("before"), size=AUDIT_PAGE_SIZE,
        )
    else:
        # A filter that did not parse shows nothing and says why, never the whole trail.
        events, next_cursor = [], None
    for event in events:
        event.changes = audit_changes(event.before, event.after)
    query = request.GET.copy()
    query.pop("before", None)
    context = {
        "form": form,
        "action_names": audit_action_names(request.user),
        "events": events,
        "next_cursor": next_cursor,
        "query": query.urlencode(),
        "can_export": tenants_for_user(request.user, "export_audit").exists(),
    }
    return page_render(request, "console/audit.html", context, partial="rows")


def _cell(value: str) -> str:
    """A spreadsheet runs a cell starting with = + - @ (or a tab or CR before one) as a
    formula; a reason or comment is anyone's text, so it is quoted as text."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _csv_rows(events) -> Iterator[list[str]]:
    yield ["id", "time", "actor", "tenant", "action", "object_type", "object_id", "reason",
           "before", "after"]
    for event in events.iterator(chunk_size=1000):
        yield [
            str(event.id), event.created_at.isoformat(),
            # As the page says it: blank would read as "someone unknown".
            _cell(event.actor_username or "system"),
            # A slug may start with "-" ("-1-1" is a valid one), which a spreadsheet runs.
            _cell(event.tenant.slug) if event.tenant else "", _cell(event.action),
            # Masked as the page shows them: what a person typed can hold an address or an
            # account number, and the export is read by whoever gets the file.
            _cell(event.object_type), _cell(event.object_id),
            _cell(mask_person_text(event.reason)),
            "" if event.before is None
            else _cell(_audit_json(payload_hashes_fingerprinted(event.before))),
            "" if event.after is None
            else _cell(_audit_json(payload_hashes_fingerprinted(event.after))),
        ]


class _Echo:
    def write(self, value: str) -> str:
        return value


@require_GET
def audit_csv(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    if not tenants_for_user(request.user, "export_audit").exists():
        raise PermissionDenied("downloading the audit trail needs the auditor or admin role")
    form = AuditFilterForm(request.GET)
    if not form.is_valid():
        # An export is evidence: a filter that did not parse must not widen it to everything.
        problems = "; ".join(form.problems())
        return HttpResponseBadRequest(
            f"The filter was not applied ({problems}); nothing was exported.",
            content_type="text/plain",
        )
    audit_trail_export_record(actor=request.user, filters=form.filters())
    events = audit_events_for_user(request.user, filters=form.filters(), perm="export_audit")
    # Every cell quoted: a spreadsheet in a locale that splits on ";" (Russian, German,
    # French) would start a cell, and a formula, after a ";" inside an unquoted reason.
    writer = csv.writer(_Echo(), quoting=csv.QUOTE_ALL)
    response = StreamingHttpResponse(
        # The byte order mark says UTF-8 inside the saved file, where the header's charset
        # is gone: without it Excel reads the system code page and garbles Cyrillic reasons.
        chain(["\ufeff"], (writer.writerow(row) for row in _csv_rows(events))),
        content_type="text/csv; charset=utf-8",
    )
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    response["Content-Disposition"] = f'attachment; filename="audit-{stamp}.csv"'
    return response
