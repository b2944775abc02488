from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from operations.models import Operation
from operations.providers.transport import shared_client_close
from tests.operations.engine_helpers import make_unknown, prepared_payment
from tests.operations.providers_support import NotTheProvider

# pytest rewrites the asserts of test modules only: registered before any test imports it,
# a failing check in this helper shows its values as one in a test does.
pytest.register_assert_rewrite("tests.operations.failure_helpers")


@pytest.fixture
def acme_payment(acme) -> Operation:
    return prepared_payment(acme)


@pytest.fixture
def acme_unknown(acme) -> Operation:
    return make_unknown(prepared_payment(acme, invoice_id="inv_unknown"))


@pytest.fixture
def sandbox(live_server, settings) -> Iterator[str]:
    """The adapters talk to this test's live server; a short timeout keeps drops fast."""
    base = f"{live_server.url}/sandbox"
    settings.PAYMENTS_API_BASE = f"{base}/payments"
    settings.CRM_API_BASE = f"{base}/crm"
    settings.MAIL_API_BASE = f"{base}/mail"
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 0
    settings.PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS = 0
    yield base
    # Pooled keep-alive connections keep the live server's request threads, and their
    # database sessions, open past the test; closing them lets both end.
    shared_client_close()


@pytest.fixture
def sandbox_worker_env(sandbox) -> dict[str, str]:
    """The same provider settings, for worker processes started by a test."""
    return {
        "PAYMENTS_API_BASE": f"{sandbox}/payments",
        "CRM_API_BASE": f"{sandbox}/crm",
        "MAIL_API_BASE": f"{sandbox}/mail",
        "PAYMENTS_SEARCH_LAG_SECONDS": "0",
        "PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS": "0",
    }


@pytest.fixture
def providers(sandbox, sandbox_worker_env) -> dict[str, str]:
    """Adapters here and in worker processes talk to the sandbox of the live server."""
    return sandbox_worker_env


@pytest.fixture
def providers_drained(providers) -> Iterator[dict[str, str]]:
    """`providers`, for tests whose slow requests may outlive them: a request still running
    at the sandbox would land in the next test's database, so teardown waits for each."""
    from operations.sandbox.selectors import sandbox_requests
    from tests.helpers import wait_for

    yield providers
    wait_for(lambda: not sandbox_requests().filter(response_status__isnull=True).exists(),
             timeout=15, what="every request to end at the sandbox")


@pytest.fixture
def rate_limited(settings) -> Iterator[NotTheProvider]:
    """Every provider answers every request as Stripe answers a rate limit: 429, with
    Retry-After 600."""
    provider = NotTheProvider(
        json.dumps({"error": {"type": "invalid_request_error", "code": "rate_limit",
                              "message": "Too many requests hit the API too quickly."}}).encode(),
        "application/json", status=429, headers={"Retry-After": "600"},
    )
    provider.point_adapters_here(settings)
    yield provider
    provider.close()


@pytest.fixture
def recipient_suppressed(settings) -> Iterator[NotTheProvider]:
    """Every provider refuses every request with a 400 whose message repeats the recipient,
    as mail APIs' suppression lists do."""
    provider = NotTheProvider(
        json.dumps({"error": {
            "type": "invalid_request_error", "code": "recipient_suppressed",
            "message": "Recipient anna.petrova@example.com is on the suppression list",
        }}).encode(),
        "application/json", status=400,
    )
    provider.point_adapters_here(settings)
    yield provider
    provider.close()


@pytest.fixture
def maintenance_page(settings) -> Iterator[NotTheProvider]:
    """Every provider's address answers 200 with an HTML page (read as {}): not the provider."""
    page = NotTheProvider(b"<html><body>Back soon</body></html>", "text/html")
    page.point_adapters_here(settings)
    yield page
    page.close()
