"""Shared by the provider and sandbox tests: adapters pointed at the live sandbox."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class NotTheProvider:
    """Something at the provider's address that answers every request 200 without the
    provider's answer in it: a proxy's or maintenance page, a catch-all stub. Or, with
    `status` and `headers`, the same refusal every time (a rate limit that goes on)."""

    def __init__(
        self, body: bytes, content_type: str, *, status: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.requests.append((self.command, self.path))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @classmethod
    def answering_json(cls, body: dict[str, Any]) -> NotTheProvider:
        return cls(json.dumps(body).encode(), "application/json")

    def point_adapters_here(self, settings: Any) -> None:
        for name in ("PAYMENTS_API_BASE", "CRM_API_BASE", "MAIL_API_BASE"):
            setattr(settings, name, self.url)
        settings.PROVIDER_TIMEOUT_SECONDS = 2

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
