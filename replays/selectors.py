"""Reads for the lineage browser, filtered by the tenants the user may see."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.postgres.fields import ArrayField
from django.db.models import (
    Count,
    F,
    Func,
    IntegerField,
    OuterRef,
    QuerySet,
    Subquery,
    TextField,
)
from django.db.models.functions import Coalesce
from django.http import Http404

from operations.intents import mask_inline
from operations.models import Checkpoint, Operation, Run
from operations.selectors import keyset_page_of_tenants, tenant_ids_for_user, tenants_for_user


@dataclass(frozen=True)
class RunFilters:
    tenant: str = ""
    workflow: str = ""
    status: str = ""
    conversation: str = ""
    parent: str = ""  # a run id: the runs replayed or branched from it


def runs_page_for_user(
    user, *, filters: RunFilters, before: str | None, size: int
) -> tuple[list[Run], str | None]:
    """One page of the runs the user may see, newest first, and the cursor for the next
    page (or None): each visible tenant's page through the (tenant, -id) index
    (keyset_page_of_tenants), so a quiet tenant's runs are not found by walking back through
    every newer run of a busy one."""
    tenants = tenants_for_user(user)
    if filters.tenant:
        # Resolved to its id, not joined by slug into the page's query (see the journal's).
        tenants = tenants.filter(slug=filters.tenant)
    return keyset_page_of_tenants(
        _runs_filtered(filters), tenant_ids=list(tenants.values_list("id", flat=True)),
        before=before, size=size,
    )


def _runs_filtered(filters: RunFilters) -> QuerySet[Run]:
    """Runs of any tenant matching the filters but the tenant, as their rows are shown."""
    qs = Run.objects.all()
    if filters.workflow:
        qs = qs.filter(workflow_name=filters.workflow)
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.conversation:
        qs = qs.filter(conversation_id=filters.conversation)
    if filters.parent:
        # Within the run's tenant, as its page lists them: not another tenant's run's ids.
        qs = qs.filter(parent_run_id=filters.parent, parent_run__tenant_id=F("tenant_id"))
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


def _parent_checkpoint_in_parent():
    """The checkpoint a run came from, only when it is one of its parent run's in the run's
    tenant, as the run's parent is named: a row from before operations 0025 can name
    another tenant's checkpoint under a parent of its own tenant."""
    return Checkpoint.objects.filter(
        id=OuterRef("parent_checkpoint_id"), run_id=OuterRef("parent_run_id"),
        run__tenant_id=OuterRef("tenant_id"),
    ).values("id")[:1]


def run_for_user(user, run_id: str) -> Run:
    """One run: 404 unless the user may see its tenant. With `parent_checkpoint_in_parent_id`
    (see _parent_checkpoint_in_parent)."""
    run = (
        Run.objects.select_related("tenant", "launched_by")
        .filter(id=run_id, tenant_id__in=tenant_ids_for_user(user))
        .annotate(parent_checkpoint_in_parent_id=Subquery(_parent_checkpoint_in_parent()))
        .first()
    )
    if run is None:
        raise Http404("no such run")
    return run


def run_children(run: Run) -> QuerySet[Run]:
    """The runs replayed or branched from this one, in its tenant, newest first, with
    `parent_checkpoint_in_parent_id` (see _parent_checkpoint_in_parent)."""
    return (
        run.children.filter(tenant_id=run.tenant_id)
        .select_related("launched_by")
        .annotate(parent_checkpoint_in_parent_id=Subquery(_parent_checkpoint_in_parent()))
        .order_by("-id")
    )


class _ObjectFieldNames(Func):
    """The names of a JSON object's fields in jsonb's order; none for any other value."""

    template = (
        "ARRAY(SELECT jsonb_object_keys(v) FROM (SELECT %(expressions)s AS v) AS json_value"
        " WHERE jsonb_typeof(v) = 'object')"
    )
    output_field = ArrayField(TextField())


class _ArrayLength(Func):
    """How many items a JSON array holds; 0 for any other value."""

    template = (
        "COALESCE((SELECT jsonb_array_length(v) FROM (SELECT %(expressions)s AS v) AS json_value"
        " WHERE jsonb_typeof(v) = 'array'), 0)"
    )
    output_field = IntegerField()


def run_checkpoints(run: Run) -> QuerySet[Checkpoint]:
    """The run's checkpoints, newest first, with `state_field_names` and
    `recorded_input_count` read in PostgreSQL: a state and its recorded inputs (LLM
    responses, tool reads) can be large, and the page shows neither."""
    return (
        run.checkpoints.only("id", "run", "sequence", "node", "state_hash", "created_at")
        .annotate(state_field_names=_ObjectFieldNames("state"),
                  recorded_input_count=_ArrayLength("recorded_inputs"))
        .order_by("-sequence")
    )


def checkpoints_with_state_fields(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    """Each with `state_fields`: the names of its state's fields, the only part of a state a
    page shows (values can hold personal data). Named here, not in the template, where
    `state.keys` is a lookup of a field called "keys" first."""
    for cp in checkpoints:
        # Masked as an intent's keys are: a state keyed by recipient or account names them.
        cp.state_fields = [mask_inline(name) for name in cp.state_field_names]
    return checkpoints


def run_operations(run: Run) -> QuerySet[Operation]:
    """The run's effects, newest first, without what the page does not show of them, and
    with what operation_lineage reads of their checkpoints and the intents they replace."""
    # The run's tenant only, as everywhere on these pages (prepare refuses a mix anyway).
    return (
        run.operations.filter(tenant_id=run.tenant_id)
        .select_related("checkpoint", "supersedes")
        .only("id", "tenant", "run", "action", "payload", "status", "command_id",
              "checkpoint__id", "checkpoint__run", "checkpoint__sequence", "checkpoint__node",
              "supersedes__id", "supersedes__tenant")
        .order_by("-id")
    )
