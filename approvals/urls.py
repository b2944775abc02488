from __future__ import annotations

from django.urls import path

from approvals import views

app_name = "approvals"

urlpatterns = [
    path("", views.queue, name="queue"),
    path("<id:approval_id>/", views.detail, name="detail"),
    path("<id:approval_id>/approve", views.approve, name="approve"),
    path("<id:approval_id>/reject", views.reject, name="reject"),
]
