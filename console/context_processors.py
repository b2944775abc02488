from __future__ import annotations

from django.urls import NoReverseMatch, reverse

from console.roles import user_roles

NAVIGATION = (
    ("dashboard", "Dashboard"),
    ("operations:list", "Operations"),
    ("approvals:queue", "Approvals"),
    ("replays:runs", "Runs"),
    ("audit", "Audit"),
)


def _navigation() -> list[tuple[str, str]]:
    # Only pages this build serves appear; an app's pages join when its urls are included.
    items = []
    for name, label in NAVIGATION:
        try:
            items.append((reverse(name), label))
        except NoReverseMatch:
            continue
    return items


def shell(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "navigation": _navigation(),
        "user_roles": user_roles(user) if user is not None else [],
    }
