"""Signing in again after the session ran out, from a fragment or a form."""

from __future__ import annotations

from urllib.parse import urlsplit

from django.contrib.auth import middleware as auth_middleware
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponse
from django.shortcuts import render, resolve_url
from django.urls import Resolver404, resolve, reverse
from django.utils.http import url_has_allowed_host_and_scheme

# The POST-only action URLs, and the page of what each acts on. Without JavaScript a refused
# form is rendered again at its action's URL, so the address bar, and the Referer of the
# next request sent from that page, name a URL whose GET is a blank 405.
ACTION_PAGES = {
    "operations:reconcile": "operations:detail",
    "operations:resolve": "operations:detail",
    "operations:dispute": "operations:detail",
    "approvals:approve": "approvals:detail",
    "approvals:reject": "approvals:detail",
}


def action_page(url: str) -> str | None:
    """The operation's or approval's page when `url` is one of its actions' URLs, to send
    a person back to instead; else None."""
    try:
        match = resolve(urlsplit(url).path)
    except Resolver404:
        return None
    page = ACTION_PAGES.get(match.view_name)
    return reverse(page, kwargs=match.kwargs) if page else None


class LoginRequiredMiddleware(auth_middleware.LoginRequiredMiddleware):
    """As Django's, but never sends a person back to a fragment or a POST-only URL: htmx
    follows a redirect itself (the sign-in page would be swapped into a card or the queue),
    and after signing in a GET of `/approve` is a 405. They return to the page they were on."""

    def handle_no_permission(self, request, view_func):
        is_htmx = request.headers.get("HX-Request") == "true"
        if not is_htmx and request.method in ("GET", "HEAD"):
            return super().handle_no_permission(request, view_func)
        page = request.headers.get("HX-Current-URL") if is_htmx else request.headers.get(
            "Referer"
        )
        here = "/"
        if page and url_has_allowed_host_and_scheme(
            page, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        ):
            parts = urlsplit(page)
            here = action_page(page) or parts.path + (f"?{parts.query}" if parts.query else "")
        login = redirect_to_login(
            here, resolve_url(self.get_login_url(view_func)),
            self.get_redirect_field_name(view_func),
        )
        location = login["Location"]
        if is_htmx and request.method == "GET" and request.headers.get("X-Console-Poll") == "true":
            # A page refreshing itself, not something the person did: sending the page to
            # sign in would throw away what they were typing (evidence, a reason). Say it at
            # the top of the page instead, replacing nothing else; 286 stops the polling.
            notice = render(request, "includes/signed_out.html", {"login_url": location},
                            status=286)
            notice["HX-Retarget"] = "#session-notice"
            notice["HX-Reswap"] = "innerHTML"
            return notice
        if request.method not in ("GET", "HEAD"):
            # An approval or an operator's action was refused, not carried out: the sign-in
            # page says so, or the person would take it as done.
            location += "&not_done=1"
        if not is_htmx:
            login["Location"] = location
            return login
        response = HttpResponse(status=204)  # nothing to swap; the browser goes to sign in
        response["HX-Redirect"] = location
        return response
