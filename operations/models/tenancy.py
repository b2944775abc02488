from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F
from django.db.models.functions import Upper


class Tenant(models.Model):
    """A customer organisation. Every permission a person holds is held on one tenant."""

    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    # The legal entity that pays or acts on the tenant's behalf; shown to approvers.
    legal_entity = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        permissions = [
            ("approve_intents", "Approve or reject intents of the tenant"),
            ("operate_operations", "Reconcile, resolve and dispute operations of the tenant"),
            ("redeliver_effects", "Redeliver an effect of the tenant (privileged)"),
            ("replay_runs", "Continue, replay and branch runs of the tenant"),
            ("replay_live_irreversible", "Replay live with irreversible effects (privileged)"),
            ("view_unmasked", "See unmasked intent values of the tenant (audited)"),
            ("view_audit", "Browse the tenant's audit trail"),
            ("export_audit", "Download the tenant's audit trail as CSV"),
        ]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    APPROVER = "Approver"
    OPERATOR = "Operator"
    AUDITOR = "Auditor"
    ADMIN = "Admin"


class TenantRole(models.Model):
    """A role a person holds on one tenant. Their guardian permissions on the tenant are the
    union of what these roles give, so revoking one role keeps what another still grants."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_roles"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="user_roles")
    role = models.CharField(max_length=20, choices=Role)
    granted_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "role"]
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant", "role"], name="tenant_role_once"),
            models.CheckConstraint(
                condition=models.Q(role__in=Role.values), name="tenant_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.role} on {self.tenant_id}"


class AuditEvent(models.Model):
    """One human or system action. Append-only: a trigger refuses UPDATE and DELETE."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # PROTECT: an actor with audit history is deactivated, never deleted.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    # Kept as text too, so the trail reads the same after a rename.
    actor_username = models.CharField(max_length=150, blank=True)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=100)
    object_type = models.CharField(max_length=50, blank=True)
    # As long as the longest id it holds: a user's is their username (up to 150 characters).
    object_id = models.CharField(max_length=150, blank=True)
    reason = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="audit_tenant_id"),
            models.Index(fields=["object_type", "object_id"], name="audit_object"),
            models.Index(fields=["action", "-id"], name="audit_action_id"),
            # The filter's suggestions: the names on the part of the trail a user reads.
            models.Index(fields=["tenant", "action"], name="audit_tenant_action"),
            # The trail filtered by object or by person, newest first, a page at a time
            # (page and CSV alike): few events match, so without these each such page read
            # the tenant's whole trail. audit_object cannot serve the filter, which names no
            # object_type; a person's name is matched in any case (UPPER = UPPER).
            models.Index(fields=["tenant", "object_id", "-id"], name="audit_tenant_object_id"),
            models.Index(
                F("tenant"), Upper("actor_username"), F("id").desc(),
                name="audit_tenant_actor_id",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.actor_username or 'system'} {self.action} {self.object_id}"
