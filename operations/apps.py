from __future__ import annotations

from django.apps import AppConfig


class OperationsConfig(AppConfig):
    name = "operations"
    verbose_name = "Operations journal"

    def ready(self) -> None:
        from django.urls import register_converter

        from operations.ids import PathIdConverter

        # Before any URLconf loads: the operations, approvals and runs pages all take ids.
        register_converter(PathIdConverter, "id")
