from __future__ import annotations

from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"

    def ready(self) -> None:
        from approvals.receivers import on_operation_prepared, on_operation_related_pages
        from operations.signals import operation_prepared, operation_related_pages

        operation_prepared.connect(
            on_operation_prepared, dispatch_uid="approvals.on_operation_prepared"
        )
        operation_related_pages.connect(
            on_operation_related_pages, dispatch_uid="approvals.on_operation_related_pages"
        )
