"""Reads for the lineage browser, filtered by the tenants the user may see."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import Http404

from operations.intents import mask_inline
from operations.models import Checkpoint, Operation, Run
from operations.selectors import tenant_ids_for_user


@dataclass(frozen=True)
class RunFilters:
    tenant: str = ""
    workflow: str = ""
    status: str = ""
    conversation: str = ""


def runs_for_user(user, *, filters: RunFilters) -> QuerySet[Run]:
    qs = Run.objects.filter(tenant_id__in=tenant_ids_for_user(user))
    if filters.tenant:
        qs = qs.filter(tenant__slug=filters.tenant)
    if filters.workflow:
        qs = qs.filter(workflow_name=filters.workflow)
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.conversation:
        qs = qs.filter(conversation_id=filters.conversation)
    # A correlated count, evaluated only for the rows of the page: a joined Count would make
    # PostgreSQL group every matching run before the keyset LIMIT could stop it.
    operation_count = (
        Operation.objects.filter(run=OuterRef("pk"), tenant=OuterRef("tenant"))
        .order_by()
        .values("run")
        .annotate(n=Count("id"))
        .values("n")
    )
    # The parent only within the run's tenant, as the run's page names it: lineage never
    # names another tenant's run (a row that got there by hand included).
    parent_in_tenant = Run.objects.filter(
        id=OuterRef("parent_run_id"), tenant=OuterRef("tenant")
    ).values("id")[:1]
    return (
        qs.select_related("tenant", "launched_by")
        .annotate(operation_count=Coalesce(Subquery(operation_count), 0,
                                           output_field=IntegerField()),
                  parent_in_tenant_id=Subquery(parent_in_tenant))
        .order_by("-id")
    )


def run_for_user(user, run_id: str) -> Run:
    """One run: 404 unless the user may see its tenant."""
    run = (
        Run.objects.select_related("tenant", "launched_by")
        .filter(id=run_id, tenant_id__in=tenant_ids_for_user(user))
        .first()
    )
    if run is None:
        raise Http404("no such run")
    return run


def run_children(run: Run) -> list[Run]:
    return list(
        run.children.filter(tenant_id=run.tenant_id).select_related("launched_by").order_by("id")
    )


def run_checkpoints(run: Run) -> list[Checkpoint]:
    """The run's checkpoints, each with `state_fields`: the names of its state's fields, the
    only part of a state a page shows (values can hold personal data). Named here, not in
    the template, where `state.keys` is a lookup of a field called "keys" first."""
    checkpoints = list(run.checkpoints.select_related("created_by").order_by("sequence"))
    for cp in checkpoints:
        # Masked as an intent's keys are: a state keyed by recipient or account names them.
        cp.state_fields = (
            [mask_inline(name) for name in cp.state] if isinstance(cp.state, dict) else []
        )
    return checkpoints


def run_operations(run: Run) -> list[Operation]:
    # The run's tenant only, as everywhere on these pages (prepare refuses a mix anyway).
    return list(run.operations.filter(tenant_id=run.tenant_id).order_by("id"))
