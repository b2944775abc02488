from __future__ import annotations

from django.urls import path

from operations.sandbox.views import crm, mail, payments

app_name = "sandbox"

urlpatterns = [
    path("payments/v1/payment_intents", payments.payment_intents, name="payment_intents"),
    path("payments/v1/payment_intents/search", payments.payment_intents_search,
         name="payment_intents_search"),
    path("payments/v1/payment_intents/<str:intent_id>", payments.payment_intent,
         name="payment_intent"),
    path("crm/deals", crm.deals, name="deals"),
    path("crm/deals/<str:deal_id>", crm.deal, name="deal"),
    path("mail/messages", mail.messages, name="messages"),
    path("mail/messages/<str:message_id>", mail.message, name="message"),
]
