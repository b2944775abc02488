from __future__ import annotations

from django.urls import path

from replays import views

app_name = "replays"

urlpatterns = [
    path("", views.run_list, name="runs"),
    # The id in the query string: the agent's runtime writes it, and any text it holds ("/",
    # "?", a lone "..") reaches the page there, where a path segment cannot carry it.
    path("conversations/", views.conversation_detail, name="conversation"),
    # Links written before then, to ids a path segment carries.
    path("conversations/<id:conversation_id>/", views.conversation_detail),
    path("<id:run_id>/", views.run_detail, name="run"),
]
