"""The sandbox providers' own state: what a real payments, CRM and mail provider would hold."""

from __future__ import annotations

import secrets

from django.db import models
from ulid import ULID

# The contracts' sizes, from the adapters that speak them: one number for both sides.
from operations.providers.crm import DEAL_TEXT_MAX_LENGTHS
from operations.providers.mail import ADDRESS_MAX_LENGTH


def sandbox_id(prefix: str) -> str:
    return f"{prefix}_{ULID()}"


def _pi_id() -> str:
    return sandbox_id("pi")


def _deal_id() -> str:
    return sandbox_id("deal")


def _msg_id() -> str:
    return sandbox_id("msg")


def request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class Provider(models.TextChoices):
    PAYMENTS = "payments", "Payments"
    CRM = "crm", "CRM"
    MAIL = "mail", "Mail"


class FaultKind(models.TextChoices):
    COMMIT_THEN_DROP = "commit_then_drop", "Commit, then answer too late"
    DELAY = "delay", "Sleep before doing anything"
    SLOW = "slow", (
        "Claim the Idempotency-Key, then stall before the work: a same-key request meanwhile "
        "gets 409"
    )
    HTTP_500 = "http_500", "Answer 500 without doing anything"
    HTTP_500_AFTER_COMMIT = "http_500_after_commit", "Commit, then answer 500"
    HTTP_500_KEPT = "http_500_kept", "Answer 500 and keep it for the key, creating nothing"
    VALIDATION_ERROR = "validation_error", "Answer 400 invalid_request_error"
    CARD_DECLINED = "card_declined", "Decline the card: 402, with the PaymentIntent it made"
    REQUIRES_ACTION = "requires_action", "Ask for the customer's 3-D Secure authentication"
    SEARCH_LAG = "search_lag", "Search misses recent objects"
    DUPLICATE_WEBHOOK = "duplicate_webhook", "Send a webhook twice"
    LATE_WEBHOOK = "late_webhook", "Hold a webhook back one delivery round"
    OUT_OF_ORDER_WEBHOOKS = "out_of_order_webhooks", "Send a round of webhooks in reverse"


class SandboxFault(models.Model):
    """A fault to inject; `match` is an operation id, an Idempotency-Key (as long as the
    providers take one), or "*" for every request."""

    provider = models.CharField(max_length=20, choices=Provider)
    match = models.CharField(max_length=255, default="*")
    kind = models.CharField(max_length=40, choices=FaultKind)
    # Taken one per matching request; search_lag ignores it and stays on until cleared.
    remaining = models.PositiveIntegerField(default=1)
    params = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        # search_lag is a standing condition, not a count of requests.
        left = "until cleared" if self.kind == FaultKind.SEARCH_LAG else f"x{self.remaining}"
        return f"{self.provider}:{self.kind}[{self.match}] {left}"


class SandboxRequest(models.Model):
    """Every request that reached a sandbox provider, so tests can count them exactly."""

    provider = models.CharField(max_length=20, choices=Provider)
    method = models.CharField(max_length=10)
    path = models.CharField(max_length=300)
    idempotency_key = models.CharField(max_length=255, blank=True)
    operation_id = models.CharField(max_length=120, blank=True, db_index=True)
    params_hash = models.CharField(max_length=71, blank=True)
    # Null while the request is still being answered (or was dropped mid-way).
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=40)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.provider} {self.method} {self.path} -> {self.response_status}"


class IdempotencyRecord(models.Model):
    """Stripe's idempotency: one row per key, inserted before the work starts. (Stripe scopes
    keys by account; the sandbox serves one account, whose API key every request carries.)"""

    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=71)
    # Null while the first request is in flight: a concurrent same-key request gets 409.
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["key"], name="sandbox_idempotency_key"),
        ]

    def __str__(self) -> str:
        return self.key


class PaymentIntent(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=_pi_id, editable=False)
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=30)
    metadata = models.JSONField(default=dict, blank=True)
    last_payment_error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return self.id


class Deal(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=_deal_id, editable=False)
    name = models.CharField(max_length=DEAL_TEXT_MAX_LENGTHS["name"])
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    owner = models.CharField(max_length=DEAL_TEXT_MAX_LENGTHS["owner"], blank=True)
    stage = models.CharField(max_length=DEAL_TEXT_MAX_LENGTHS["stage"], default="open")
    version = models.PositiveIntegerField(default=1)
    # Deliberately not unique: a CRM without the constraint can hold duplicates, and the
    # console must be able to show that data incident.
    agent_operation_id = models.CharField(max_length=120, blank=True, db_index=True)
    applied_operation_ids = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return self.id


class Message(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=_msg_id, editable=False)
    to = models.CharField(max_length=ADDRESS_MAX_LENGTH)
    template = models.CharField(max_length=100)
    params = models.JSONField(default=dict, blank=True)
    operation_id = models.CharField(max_length=120, blank=True)
    # Null when sent without a key; PostgreSQL lets any number of NULLs through the constraint.
    idempotency_key = models.CharField(max_length=255, null=True, blank=True, unique=True)
    fingerprint = models.CharField(max_length=71, blank=True)
    status = models.CharField(max_length=20, default="queued")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return self.id


class SandboxWebhook(models.Model):
    """An outbound event, kept until it has been delivered."""

    provider = models.CharField(max_length=20, choices=Provider)
    event_id = models.CharField(max_length=60, unique=True)
    type = models.CharField(max_length=60)
    operation_id = models.CharField(max_length=120, blank=True)
    body = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.provider}:{self.type}:{self.event_id}"
