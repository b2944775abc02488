"""Shared by the provider and sandbox tests: adapters pointed at the live sandbox."""

from __future__ import annotations

from typing import Any

from operations.ids import new_id
from operations.providers.base import OperationSnapshot


def snapshot(action: str, payload: dict[str, Any], **fields: Any) -> OperationSnapshot:
    op_id = fields.pop("id", None) or new_id("op")
    return OperationSnapshot(
        id=op_id, action=action, tenant=fields.pop("tenant", "acme"), payload=payload,
        idempotency_key=fields.pop("idempotency_key", f"idem-{op_id}"), **fields,
    )


def payment(amount_minor: int = 12_500, **fields: Any) -> OperationSnapshot:
    return snapshot(
        "payments.create",
        {"amount_minor": amount_minor, "currency": "EUR", "invoice_id": "inv_42",
         "beneficiary_id": "ben_7"},
        **fields,
    )
