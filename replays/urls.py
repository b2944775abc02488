from __future__ import annotations

from django.urls import path

from replays import views

app_name = "replays"

urlpatterns = [
    path("", views.run_list, name="runs"),
    path("conversations/<id:conversation_id>/", views.conversation_detail, name="conversation"),
    path("<id:run_id>/", views.run_detail, name="run"),
]
