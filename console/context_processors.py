from __future__ import annotations

from django.urls import NoReverseMatch, reverse

from console.roles import user_roles
from operations.selectors import tenants_for_user

# (url name, label, the permission on some tenant it needs, if any)
NAVIGATION = (
    ("dashboard", "Dashboard", ""),
    ("operations:list", "Operations", ""),
    ("approvals:queue", "Approvals", ""),
    ("replays:runs", "Runs", ""),
    ("audit", "Audit", "view_audit"),
)


def _navigation(user, path: str) -> list[tuple[str, str, str]]:
    """(href, label, aria-current): "page" on the section's own page, "true" on a page
    inside it (an operation, the unknown queue, a run), so a person sees where they are."""
    # Only pages this build serves appear; an app's pages join when its urls are included.
    # A page the user may not open is not offered.
    items = []
    for name, label, perm in NAVIGATION:
        if perm and not (user is not None and tenants_for_user(user, perm).exists()):
            continue
        try:
            href = reverse(name)
        except NoReverseMatch:
            continue
        current = (
            "page" if path == href
            else "true" if href != "/" and path.startswith(href)
            else ""
        )
        items.append((href, label, current))
    return items


def shell(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "navigation": _navigation(user, request.path),
        "user_roles": user_roles(user) if user is not None else [],
    }
