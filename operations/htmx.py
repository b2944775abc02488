"""What every page shares: how it answers htmx, and when it may show unmasked values."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.cache import add_never_cache_headers, patch_vary_headers

from operations.models import Tenant
from operations.selectors import tenant_perm_held
from operations.services import audit_event_record


def fragment_requested(request: HttpRequest) -> bool:
    """Whether page_render answers with the partial: a view may then skip what only the
    rest of the page shows."""
    # htmx's history restore (Back to a pushed URL it no longer caches) also says HX-Request,
    # but it replaces the whole body: it needs the page, not the fragment.
    return bool(request.htmx) and not request.htmx.history_restore_request


def page_render(
    request: HttpRequest, template: str, context: dict[str, Any], *, partial: str
) -> HttpResponse:
    swap = fragment_requested(request)
    response = render(request, f"{template}#{partial}" if swap else template, context)
    # One URL answers a fragment or a page, by both headers: a cache must never hand one out
    # for the other (a fragment as the page Back restores, a page inside the table).
    patch_vary_headers(response, ("HX-Request", "HX-History-Restore-Request"))
    return response


def page_unmasking(
    request: HttpRequest, tenant: Tenant, *, action: str, object_type: str, object_id: str,
    **audit: Any,
) -> tuple[bool, bool]:
    """(unmasked, may_unmask). Pages are masked by default: unmasked only when asked for
    (`?unmasked=1`, a full page, never an htmx refresh) by someone holding view_unmasked on
    the tenant, and then on the audit trail, once per such page."""
    may_unmask = tenant_perm_held(request.user, "view_unmasked", tenant)
    unmasked = may_unmask and request.GET.get("unmasked") == "1" and not request.htmx
    if unmasked:
        audit_event_record(actor=request.user, action=action, tenant=tenant,
                           object_type=object_type, object_id=object_id, **audit)
    return unmasked, may_unmask


def unmasked_never_cached(response: HttpResponse, *, unmasked: bool) -> HttpResponse:
    """An unmasked page is shown once and audited once: neither the browser (Back, its disk
    cache) nor a proxy may show it again."""
    if unmasked:
        add_never_cache_headers(response)
    return response
