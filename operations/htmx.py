"""How a page answers htmx: the named partial for an in-page swap, the whole page otherwise."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.cache import patch_vary_headers


def page_render(
    request: HttpRequest, template: str, context: dict[str, Any], *, partial: str
) -> HttpResponse:
    # htmx's history restore (Back to a pushed URL it no longer caches) also says HX-Request,
    # but it replaces the whole body: it needs the page, not the fragment.
    swap = bool(request.htmx) and not request.htmx.history_restore_request
    response = render(request, f"{template}#{partial}" if swap else template, context)
    # One URL answers a fragment or a page: a cache must never hand one out for the other.
    patch_vary_headers(response, ("HX-Request",))
    return response
