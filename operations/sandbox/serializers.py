"""The sandbox objects as the providers' APIs show them (Stripe's PaymentIntent, the CRM's
deal, the mail API's message): what its answers and its webhooks carry."""

from __future__ import annotations

from typing import Any

from operations.sandbox.models import Deal, Message, PaymentIntent


def payment_intent_json(intent: PaymentIntent) -> dict[str, Any]:
    return {
        "id": intent.id,
        "object": "payment_intent",
        "amount": intent.amount,
        "currency": intent.currency,
        "status": intent.status,
        "metadata": intent.metadata,
        "last_payment_error": intent.last_payment_error,
        "created": int(intent.created_at.timestamp()),
        "livemode": False,
    }


# What Stripe puts in a declined attempt's last_payment_error and in its 402 answer.
CARD_DECLINED = {"type": "card_error", "code": "card_declined", "decline_code": "generic_decline",
                 "message": "Your card was declined."}


def card_declined_json(intent: dict[str, Any]) -> dict[str, Any]:
    """Stripe's answer to a confirm=true create whose card is declined: a 402 card_error that
    carries the PaymentIntent the request made, left in requires_payment_method."""
    return {"error": {**CARD_DECLINED, "payment_intent": intent}}


def deal_json(deal: Deal) -> dict[str, Any]:
    return {
        "id": deal.id,
        "object": "deal",
        "name": deal.name,
        "amount_minor": deal.amount_minor,
        "currency": deal.currency,
        "owner": deal.owner,
        "stage": deal.stage,
        "version": deal.version,
        "agent_operation_id": deal.agent_operation_id,
        "applied_operation_ids": deal.applied_operation_ids,
        "created": int(deal.created_at.timestamp()),
        "updated": int(deal.updated_at.timestamp()),
    }


def message_json(message: Message) -> dict[str, Any]:
    return {
        "id": message.id,
        "object": "message",
        "to": message.to,
        "template": message.template,
        "params": message.params,
        "status": message.status,
        "operation_id": message.operation_id,
        "idempotency_key": message.idempotency_key or "",
        "created": int(message.created_at.timestamp()),
    }
