from __future__ import annotations

from django.urls import path

from operations import views

app_name = "operations"

urlpatterns = [
    path("", views.operation_list, name="list"),
    path("unknown/", views.operation_unknown, name="unknown"),
    path("<id:operation_id>/", views.operation_detail, name="detail"),
    path("<id:operation_id>/reconcile", views.operation_reconcile_view, name="reconcile"),
    path("<id:operation_id>/resolve", views.operation_resolve_view, name="resolve"),
    path("<id:operation_id>/dispute", views.operation_dispute_view, name="dispute"),
]
