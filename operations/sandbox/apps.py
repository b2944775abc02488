from __future__ import annotations

from django.apps import AppConfig


class SandboxConfig(AppConfig):
    name = "operations.sandbox"
    label = "sandbox"
    verbose_name = "Sandbox providers"
    default_auto_field = "django.db.models.BigAutoField"
