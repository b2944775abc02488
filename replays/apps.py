from __future__ import annotations

from django.apps import AppConfig


class ReplaysConfig(AppConfig):
    name = "replays"
