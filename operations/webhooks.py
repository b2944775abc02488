"""Provider webhooks: verify, store once per event id, apply only allowed transitions."""

from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from operations.engine import webhook_apply
from operations.providers import webhook_verifier_for
from operations.providers.base import WebhookSignatureError


@login_not_required
@csrf_exempt  # authenticated by the provider's signature over the raw body instead
@require_POST
def webhook_receive(request: HttpRequest, provider: str) -> JsonResponse:
    try:
        verifier = webhook_verifier_for(provider)
    except KeyError:
        return JsonResponse({"error": f"unknown provider {provider!r}"}, status=404)
    try:
        facts = verifier.parse_webhook(headers=request.headers, body=request.body)
    except WebhookSignatureError as exc:
        # Nothing is stored for an unsigned body: it is not evidence of anything.
        return JsonResponse({"error": f"bad signature: {exc}"}, status=400)
    except ValueError as exc:
        return JsonResponse({"error": f"malformed event: {exc}"}, status=400)
    result, message = webhook_apply(provider=provider, facts=facts)
    # Duplicates and ignored events answer 200 too: the provider must stop resending them.
    return JsonResponse({"result": result, "detail": message}, status=200)


urlpatterns = [path("<slug:provider>/", webhook_receive, name="webhook_receive")]
