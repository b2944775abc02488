"""The address a sign-in came from: django-axes pauses it, with the username, after too many
wrong passwords (see settings, LOGIN_FAILURE_LIMIT)."""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def sign_in_address(request: HttpRequest) -> str | None:
    proxies = settings.FORWARDING_PROXIES
    connection = request.META.get("REMOTE_ADDR")
    if not proxies:
        return connection
    # Each front server appends the address it was reached from, after whatever the request
    # already carried: the client's is the one the outermost wrote, `proxies` entries from
    # the end. Everything before it is the client's own writing and is never parsed, only
    # split on commas (a quote there must not join entries as a header parser would: one
    # unclosed quote swallowed the front server's entry and handed the pause to an address
    # the guesser chose).
    entries = [entry.strip() for entry in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    if len(entries) < proxies:
        # It did not come through them all: its own connection is all there is to go by.
        return connection
    try:
        return str(ipaddress.ip_address(entries[-proxies]))
    except ValueError:
        # Not what a front server writes (a port, a name): the front server's own address,
        # as with no setting, rather than a text the pause would count apart.
        return connection
