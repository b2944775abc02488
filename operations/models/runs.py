from __future__ import annotations

from django.conf import settings
from django.db import models

from operations.ids import new_id
from operations.models.tenancy import Tenant


def _run_id() -> str:
    return new_id("run")


def _checkpoint_id() -> str:
    return new_id("cp")


class RunStatus(models.TextChoices):
    RUNNING = "running", "Running"
    WAITING_APPROVAL = "waiting_approval", "Waiting for approval"
    PAUSED = "paused", "Paused"
    FAILED = "failed", "Failed"
    SUCCEEDED = "succeeded", "Succeeded"
    CANCELLED = "cancelled", "Cancelled"


class RunMode(models.TextChoices):
    ORIGINAL = "original", "Original"
    EVIDENCE = "evidence", "Evidence (recorded outputs, no calls)"
    SIMULATION = "simulation", "Simulation (sandbox providers only)"
    LIVE = "live", "Live (real calls)"
    BRANCH = "branch", "Branch with change"


class Run(models.Model):
    """One execution of a workflow graph. A replay or a branch is a new run. Never
    deleted: a trigger refuses it (migration 0030), as the record of who launched what."""

    id = models.CharField(primary_key=True, max_length=40, default=_run_id, editable=False)
    conversation_id = models.CharField(max_length=40, db_index=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="runs")
    workflow_name = models.CharField(max_length=100)
    workflow_version = models.PositiveIntegerField()
    state_schema_version = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=RunStatus, default=RunStatus.RUNNING)
    parent_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )
    parent_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    launch_reason = models.TextField(blank=True)
    mode = models.CharField(max_length=20, choices=RunMode, default=RunMode.ORIGINAL)
    launched_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # The run list's pages, a tenant at a time (keyset_page_of_tenants).
            models.Index(fields=["tenant", "-id"], name="run_tenant_id"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=RunStatus.values), name="run_status_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(mode__in=RunMode.values), name="run_mode_valid"
            ),
            # Every run is part of a conversation, and its pages link that conversation: a blank
            # id names none, and no page could lead to it. In the database a trigger of this
            # name refuses it on INSERT only (0027): a run written blank before then keeps its
            # status updatable, which a CHECK, even NOT VALID, would refuse.
            models.CheckConstraint(
                condition=models.Q(conversation_id__regex=r"\S"), name="run_conversation_named"
            ),
            # Lineage is all or nothing: a derived run names its parent and its checkpoint,
            models.CheckConstraint(
                condition=models.Q(mode=RunMode.ORIGINAL, parent_run__isnull=True)
                | (
                    ~models.Q(mode=RunMode.ORIGINAL)
                    & models.Q(parent_run__isnull=False, parent_checkpoint__isnull=False)
                ),
                name="run_lineage_complete",
            ),
            # and why a person launched it (a blank reason is none). Lineage never changes
            # once written: a trigger (migration 0026) refuses it.
            models.CheckConstraint(
                condition=models.Q(mode=RunMode.ORIGINAL) | models.Q(launch_reason__regex=r"\S"),
                name="run_derived_has_reason",
            ),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def launcher_shown(self) -> str:
        """Who launched it, as every page names them. A replay or a branch is a person's
        decision: one whose launcher was not recorded is "no one named" (as the approval
        card and the engine word it), never the agent, which only starts original runs."""
        if self.launched_by_id:
            return self.launched_by.get_username()
        return "no one named" if self.parent_run_id else "agent"


class InputClass(models.TextChoices):
    RECORDED_FACT = "recorded_fact", "Recorded fact"
    REPEATABLE = "repeatable", "Repeatable computation"
    LIVE_REQUEST = "live_request", "Live request"


class Checkpoint(models.Model):
    """An immutable snapshot of a run's state after a node; a trigger refuses changes."""

    id = models.CharField(
        primary_key=True, max_length=40, default=_checkpoint_id, editable=False
    )
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="checkpoints")
    sequence = models.PositiveIntegerField()
    node = models.CharField(max_length=100)
    state = models.JSONField()
    state_hash = models.CharField(max_length=71)
    # Recorded LLM responses and tool reads at this node, each tagged with its InputClass.
    recorded_inputs = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "sequence"]
        constraints = [
            models.UniqueConstraint(fields=["run", "sequence"], name="checkpoint_run_sequence"),
        ]

    def __str__(self) -> str:
        return self.id
