"""The versioned approval policy. Its version is part of every intent's hash.

Bumping a version makes every pending approval under the old one unusable: the engine
refuses to execute an operation whose policy version is not the current one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings

from operations.intents import major_units
from operations.models import Action


@dataclass(frozen=True)
class Policy:
    version: str
    approval_ttl: timedelta
    requires_approval: Callable[[Mapping[str, Any]], bool]
    rule: str  # for people: why this needs (or does not need) approval


POLICIES: dict[str, Policy] = {
    Action.PAYMENTS_CREATE: Policy(
        version="payments-v3",
        approval_ttl=timedelta(hours=4),
        requires_approval=lambda payload: True,
        rule="every payment needs a person's approval",
    ),
    Action.CRM_CREATE_DEAL: Policy(
        # v3: the threshold is in the deal's own currency units (v2 compared minor units,
        # so 50,000 JPY and 5,000 KWD counted alike as "50,000.00").
        version="crm-v3",
        approval_ttl=timedelta(hours=24),
        requires_approval=lambda payload: major_units(
            payload.get("amount_minor", 0), payload.get("currency", "")
        ) >= 50_000,
        rule="deals worth 50,000 or more in their currency need approval",
    ),
    Action.CRM_UPDATE_DEAL: Policy(
        version="crm-v2",
        approval_ttl=timedelta(hours=24),
        requires_approval=lambda payload: True,
        rule="changing a deal someone else may own needs approval",
    ),
    Action.MAIL_SEND: Policy(
        version="mail-v1",
        approval_ttl=timedelta(hours=8),
        requires_approval=lambda payload: payload.get("template") not in {"receipt", "reminder"},
        rule="emails other than receipts and reminders need approval",
    ),
}


def policy_for(action: str) -> Policy:
    policy = POLICIES[action]
    # A settings override rolls a policy's version forward: the tests stand for a release
    # that changes a policy with it (no environment variable sets it).
    override = getattr(settings, "POLICY_VERSION_OVERRIDES", {}).get(action)
    if override:
        return Policy(override, policy.approval_ttl, policy.requires_approval, policy.rule)
    return policy


def policy_version_current(action: str) -> str:
    return policy_for(action).version
