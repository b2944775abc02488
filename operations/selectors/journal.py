"""The operations journal: its pages, and one operation's lineage."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db.models import F, Lookup, QuerySet
from django.utils import timezone

from operations.ids import id_after
from operations.models import Checkpoint, Operation, Run
from operations.selectors.access import tenants_for_user
from operations.signals import RelatedPage, operation_related_pages


def keyset_page(qs: QuerySet, *, before: int | str | None, size: int, key: str = "id"):
    """One page ordered by `key` descending, and the cursor for the next page (or None).

    No OFFSET and no COUNT(*): the cost of a page is the same at row 10 and row 10 million.
    """
    if before not in (None, ""):
        qs = qs.filter(**{f"{key}__lt": before})
    rows = list(qs[: size + 1])
    next_cursor = getattr(rows[size - 1], key) if len(rows) > size else None
    return rows[:size], next_cursor


@dataclass(frozen=True)
class OperationFilters:
    status: str = ""
    tenant: str = ""  # slug
    action: str = ""
    run: str = ""
    older_than: timedelta | None = None


class _TenantAmong(Lookup):
    """`tenant_id = ANY(ARRAY[…])`, even for one tenant. Written as `tenant_id = 1`, the
    planner knows the tenant is constant, so the primary key read backwards "gives" the
    page's order too, and it prices that walk as if the tenant's rows were spread evenly
    through time. A quiet tenant beside a busy one is not: the walk reads every newer
    operation of the other tenant first (20,000 rows for a page after 100 s of 200/s, a
    million after 80 minutes). Through ANY the tenant is no constant to the planner, and only
    the (tenant, -id) index gives the order (tenant, -id) the page then asks for."""

    lookup_name = "tenant_among"
    prepare_rhs = False

    def as_sql(self, compiler, connection):
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"{lhs} = ANY({rhs}::bigint[])", [*lhs_params, *rhs_params]


def keyset_page_of_tenants(
    qs: QuerySet, *, tenant_ids: list[int], before: str | None, size: int
) -> tuple[list, str | None]:
    """keyset_page for rows of tenants with a (tenant, -id) index, newest first: each
    tenant's newest `size + 1` ids read through that index alone (see _TenantAmong), then
    merged, then those rows fetched by primary key through `qs` (with what it selects and
    annotates). What a page costs depends on how many tenants the user sees, never on how
    many rows other tenants wrote since."""
    if not tenant_ids:
        return [], None
    if before not in (None, ""):
        qs = qs.filter(id__lt=before)
    newest = [
        qs.filter(_TenantAmong(F("tenant_id"), [tenant_id]))
        .order_by("tenant_id", "-id")
        .values_list("id", flat=True)[: size + 1]
        for tenant_id in tenant_ids
    ]
    if len(newest) == 1:
        ids = list(newest[0])
    else:
        ids = list(newest[0].union(*newest[1:], all=True).order_by("-id")[: size + 1])
    rows = list(qs.filter(id__in=ids).order_by("-id")) if ids else []
    next_cursor = rows[size - 1].id if len(rows) > size else None
    return rows[:size], next_cursor


def operations_journal_page(
    user, *, filters: OperationFilters, before: str | None, size: int
) -> tuple[list[Operation], str | None]:
    """One page of the journal rows the user may see, newest first (ids are time-sortable),
    and the cursor for the next page (or None)."""
    tenants = tenants_for_user(user)
    if filters.tenant:
        # Resolved to its id here, not joined into the page's query: there the slug hides
        # from the planner which tenant it is, and a page of a quiet tenant is read off the
        # primary key through every newer operation of the others.
        tenants = tenants.filter(slug=filters.tenant)
    qs = Operation.objects.select_related("tenant")
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.action:
        qs = qs.filter(action=filters.action)
    if filters.run:
        qs = qs.filter(run_id=filters.run)
    if filters.older_than is not None:
        threshold = timezone.now() - filters.older_than
        # created_at has no index: alone, a page of "older than 1 hour" walks back through
        # every operation of that hour first. An operation's id is made from the same clock
        # just before its created_at (prepare), so none older than the threshold has an id
        # past it, and the bound starts the (tenant, -id) index there. created_at keeps the
        # answer exact; an id made while the clock had stepped back (ids stay monotonic)
        # only shows that operation here a step later.
        qs = qs.filter(id__lt=id_after("op", threshold), created_at__lt=threshold)
    return keyset_page_of_tenants(
        qs, tenant_ids=list(tenants.values_list("id", flat=True)), before=before, size=size
    )


@dataclass(frozen=True)
class OperationLineage:
    """Where an operation came from, as its pages may name it: only within its tenant."""

    run: Run | None
    checkpoint: Checkpoint | None
    supersedes: Operation | None


def operation_lineage(op: Operation) -> OperationLineage:
    """The operation's run, checkpoint and the intent it replaces, each left out when it is
    another tenant's (or the checkpoint another run's). Prepare and, since migration 0016, a
    trigger keep lineage inside the tenant; a row from before that, or written with the
    trigger off, would otherwise show one tenant another's run ids, amounts and the reasons
    its people gave. Reads the relations already loaded (select_related)."""
    run = op.run if op.run_id and op.run.tenant_id == op.tenant_id else None
    checkpoint = (
        op.checkpoint if run and op.checkpoint_id and op.checkpoint.run_id == run.id else None
    )
    supersedes = (
        op.supersedes
        if op.supersedes_id and op.supersedes.tenant_id == op.tenant_id
        else None
    )
    return OperationLineage(run=run, checkpoint=checkpoint, supersedes=supersedes)


def run_parent_in_tenant(run: Run) -> str | None:
    """The id of the run this one was replayed or branched from, if that is a run of its own
    tenant: as on the run's page, lineage never names another tenant's run (a row from before
    operations 0025 can)."""
    if not run.parent_run_id:
        return None
    return (
        Run.objects.filter(id=run.parent_run_id, tenant_id=run.tenant_id)
        .values_list("id", flat=True)
        .first()
    )


def operation_superseded_by(op: Operation) -> Operation | None:
    """The intent that replaced this one, if any, in its tenant (see operation_lineage)."""
    return (
        Operation.objects.filter(supersedes_id=op.id, tenant_id=op.tenant_id).only("id").first()
    )


def related_pages_for_user(user, op: Operation) -> list[RelatedPage]:
    """Pages other apps keep about the operation (its approvals), for a user who may see
    it: operation_for_user has already checked that."""
    return [
        page
        for _receiver, pages in operation_related_pages.send(
            sender=Operation, operation=op, user=user
        )
        for page in pages or ()
    ]
