"""The registry: which adapter performs an action, which verifier reads a provider's webhooks."""

from __future__ import annotations

from operations.providers.base import ProviderAdapter, WebhookVerifier
from operations.providers.crm import CrmCreateDealAdapter, CrmUpdateDealAdapter, CrmWebhookVerifier
from operations.providers.mail import MailSendAdapter, MailWebhookVerifier
from operations.providers.payments import PaymentsCreateAdapter, PaymentsWebhookVerifier

_ADAPTERS: dict[str, ProviderAdapter] = {
    "payments.create": PaymentsCreateAdapter(),
    "crm.create_deal": CrmCreateDealAdapter(),
    "crm.update_deal": CrmUpdateDealAdapter(),
    "mail.send": MailSendAdapter(),
}

_VERIFIERS: dict[str, WebhookVerifier] = {
    "payments": PaymentsWebhookVerifier(),
    "crm": CrmWebhookVerifier(),
    "mail": MailWebhookVerifier(),
}


def adapter_for(action: str) -> ProviderAdapter:
    try:
        return _ADAPTERS[action]
    except KeyError:
        raise KeyError(f"no provider adapter for action {action!r}") from None


def provider_for(action: str) -> str:
    return adapter_for(action).contract.provider


def webhook_verifier_for(provider: str) -> WebhookVerifier:
    try:
        return _VERIFIERS[provider]
    except KeyError:
        raise KeyError(f"no webhook verifier for provider {provider!r}") from None
