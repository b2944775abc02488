from __future__ import annotations

from django.urls import path

from operations.sandbox import views

app_name = "sandbox"

urlpatterns = [
    path("payments/v1/payment_intents", views.payment_intents, name="payment_intents"),
    path("payments/v1/payment_intents/search", views.payment_intents_search,
         name="payment_intents_search"),
    path("payments/v1/payment_intents/<str:intent_id>", views.payment_intent,
         name="payment_intent"),
    path("crm/deals", views.deals, name="deals"),
    path("crm/deals/<str:deal_id>", views.deal, name="deal"),
    path("mail/messages", views.messages, name="messages"),
    path("mail/messages/<str:message_id>", views.message, name="message"),
]
