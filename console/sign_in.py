"""The address a sign-in came from: django-axes pauses it, with the username, after too many
wrong passwords (see settings, LOGIN_FAILURE_LIMIT)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest
from ipware.ip import get_client_ip


def sign_in_address(request: HttpRequest) -> str | None:
    proxies = settings.FORWARDING_PROXIES
    if proxies:
        # The client is the address the outermost front server was reached from: the entry
        # it wrote, with one more after it from each server behind it. Entries a client
        # wrote itself stand before those and are passed over; strict, one of them
        # malformed would void the whole header.
        address, _routable = get_client_ip(
            request, proxy_count=proxies - 1, request_header_order=("HTTP_X_FORWARDED_FOR",),
            strict=False,
        )
        if address is not None:
            return address
    # No front server; or a request that did not come through them all (X-Forwarded-For
    # shorter than their number), whose own connection is all there is to go by.
    return request.META.get("REMOTE_ADDR")
