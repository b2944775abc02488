"""Reads of approvals, always filtered by the tenants the user may see."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.db.models import Count, Min, Prefetch, Q, QuerySet
from django.http import Http404
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from approvals.models import Approval, ApprovalStatus
from operations.engine import run_mode_problem
from operations.models import Operation, Run, RunMode
from operations.policy import policy_version_current
from operations.selectors import run_ancestors, tenant_access_require, tenant_ids_for_user

P = ApprovalStatus


def approval_for_user(user, approval_id: str, perm: str) -> Approval:
    """The approval if the user holds `perm` on its tenant: 404 if the tenant is not
    visible to them at all, 403 if it is visible but the permission is missing."""
    approval = (
        Approval.objects.select_related(
            "operation", "operation__tenant", "operation__run", "operation__run__launched_by",
            "operation__run__tenant", "operation__checkpoint", "operation__supersedes",
            "operation__superseded_by", "superseded_by__operation", "decided_by",
        )
        .filter(id=approval_id)
        .first()
    )
    if approval is None:
        raise Http404("No such approval.")
    tenant_access_require(user, approval.operation.tenant, perm, what="approval")
    return approval


def approval_policy_moved_to(approval: Approval) -> str:
    """The policy version now in force when it is not the one this intent was prepared and
    put up under (approving it would be refused: the engine runs intents of the policy in
    force only); empty while theirs is."""
    current = policy_version_current(approval.operation.action)
    return current if {approval.policy_version, approval.operation.policy_version} != {
        current} else ""


def approval_run_mode_problem(
    approval: Approval, *, launchers_allowed: set[tuple[int, int]] | None = None
) -> str:
    """Why the engine would never call this intent, its run's mode forbidding it (a live
    replay whose launcher has since lost replay_live_irreversible): approving it would be
    refused, as for a policy that moved on. Empty while the mode allows the call.
    `launchers_allowed`: live_launchers_allowed of the page this card is on."""
    op = approval.operation
    launcher_may = None
    if launchers_allowed is not None and op.run is not None:
        launcher_may = (op.run.launched_by_id, op.run.tenant_id) in launchers_allowed
    problem = run_mode_problem(run=op.run, action=op.action, launcher_may=launcher_may)
    if problem and op.run.tenant_id != op.tenant_id:
        # Its run is named only within its tenant (operation_lineage).
        return "its run's mode forbids the call"
    return problem


def live_launchers_allowed(approvals: Iterable[Approval]) -> set[tuple[int, int]]:
    """(launcher id, tenant id) of the pending requests' live replays whose launcher holds
    replay_live_irreversible on that tenant: a query per launcher for a whole page, where
    each card read its own launcher's grants (a live replay asks again every payment of the
    run it repeats, a page of cards with one launcher)."""
    launchers = {
        approval.operation.run.launched_by_id: approval.operation.run.launched_by
        for approval in approvals
        if approval.is_pending and approval.operation.run is not None
        and approval.operation.run.mode == RunMode.LIVE
        and approval.operation.run.launched_by is not None
    }
    return {
        (launcher_id, tenant_id)
        for launcher_id, launcher in launchers.items()
        for tenant_id in tenant_ids_for_user(launcher, "replay_live_irreversible")
    }


def approval_replaced_by(approval: Approval) -> tuple[Approval | None, Operation | None]:
    """The request and the intent that replaced this one's, each only when it is of the same
    tenant, as operation_superseded_by names the intent on the operation's page: a row from
    before operations 0016 (or written with its trigger off) can name another tenant's. Reads
    the relations approval_for_user and approvals_for_user load."""
    op = approval.operation
    successor = getattr(op, "superseded_by", None)  # a reverse one-to-one: absent raises
    if successor is not None and successor.tenant_id != op.tenant_id:
        successor = None
    request = approval.superseded_by if approval.superseded_by_id else None
    if request is not None and request.operation.tenant_id != op.tenant_id:
        request = None
    return request, successor


def approval_replacement_changed(
    approval: Approval, *, request: Approval | None, successor: Operation | None
) -> bool | None:
    """Whether the intent that replaced this superseded request is another one (True) or the
    very same, asked again (False), by payload_hash: an agent asks again unchanged when a
    request ran out, and telling the approver or the trail of a change would be untrue.
    None when no replacing intent of its tenant is known. `request` and `successor` are
    approval_replaced_by's."""
    if approval.status != P.SUPERSEDED:
        return None
    if successor is not None:
        return successor.payload_hash != approval.payload_hash
    if request is not None:
        return request.payload_hash != approval.payload_hash
    return None


def intent_authors(operation: Operation) -> list[int]:
    """Who wrote this intent or any it replaces, or launched the run of any of them: a
    person's intent asked again unchanged by the agent (as an expiry tells it to) is still
    theirs, and so is one the agent changed. The same goes for the same command in the runs
    a replay or a branch derives from: a derived run asks its nodes' commands again, so whoever
    wrote or launched the original is its author too, whoever launched the copy."""
    authors: set[int] = set()
    commands: dict[tuple[str, str], Run] = {}
    op: Operation | None = operation
    for _ in range(MAX_SUPERSEDES_WALK):
        if op is None:
            break
        authors.update(
            pk for pk in (op.created_by_id, getattr(op.run, "launched_by_id", None)) if pk
        )
        if op.run is not None and op.run.parent_run_id and op.command_id:
            commands[(op.run_id, op.command_id)] = op.run
        op = op.supersedes
    for (_, command_id), run in commands.items():
        earlier = Operation.objects.filter(
            tenant_id=operation.tenant_id, run_id__in=run_ancestors(run), command_id=command_id
        ).values_list("created_by_id", "run__launched_by_id")
        authors.update(pk for pair in earlier for pk in pair if pk)
    return sorted(authors)


# Far longer than any chain of replaced intents a person reviews: a bound, not a limit.
MAX_SUPERSEDES_WALK = 1000


# Each generation joins the intent its last one replaced, within the tenant of the intent
# the walk started from: a link into another tenant ends the chain there, as
# operation_lineage ends it on the card. UNION ALL with a depth counter: a corrupt cycle is
# cut by the bound. The nearest approved generation per origin is the newest approved one.
_LAST_APPROVED_SQL = """
WITH RECURSIVE chain (origin_id, tenant_id, operation_id, supersedes_id, depth) AS (
    SELECT start.id, start.tenant_id, parent.id, parent.supersedes_id, 1
      FROM {operation} start
      JOIN {operation} parent
        ON parent.id = start.supersedes_id AND parent.tenant_id = start.tenant_id
     WHERE start.id = ANY(%s)
    UNION ALL
    SELECT chain.origin_id, chain.tenant_id, parent.id, parent.supersedes_id, chain.depth + 1
      FROM chain
      JOIN {operation} parent
        ON parent.id = chain.supersedes_id AND parent.tenant_id = chain.tenant_id
     WHERE chain.depth < %s
)
SELECT DISTINCT ON (chain.origin_id) chain.origin_id AS walked_from, ancestor.*
  FROM chain
  JOIN {operation} ancestor ON ancestor.id = chain.operation_id
 WHERE EXISTS (
       SELECT 1 FROM {approval} approval
        WHERE approval.operation_id = chain.operation_id AND approval.status = %s)
 ORDER BY chain.origin_id, chain.depth
"""


def last_approved_ancestors(
    operations: Iterable[Operation], *, limit: int = MAX_SUPERSEDES_WALK
) -> dict[str, Operation]:
    """For each operation, by id, the newest intent among those it replaces, directly or
    down its chain, that a person approved; absent when none was. What an approver must
    see a re-asked intent's changes against: a change asked in a request that ran out
    undecided, then asked again unchanged, was otherwise never shown to anyone who decides.
    One query for all of them (a recursive CTE, bounded to `limit` generations), so a page
    of cards costs what one does at any depth. For a caller that has already checked the
    user may see the operations; the walk stays inside each one's tenant."""
    ids = [op.id for op in operations if op.supersedes_id]
    if not ids or limit < 1:
        return {}
    sql = _LAST_APPROVED_SQL.format(
        operation=connection.ops.quote_name(Operation._meta.db_table),
        approval=connection.ops.quote_name(Approval._meta.db_table),
    )
    return {
        ancestor.walked_from: ancestor
        for ancestor in Operation.objects.raw(sql, [ids, limit, P.APPROVED])
    }


def approval_is_own_intent(approval: Approval, user) -> bool:
    """Four eyes: whoever wrote the intent (or one it replaces or repeats: `intent_authors`)
    or launched the run of one of them may not approve it."""
    op = approval.operation
    return user.pk is not None and user.pk in {
        op.created_by_id, getattr(op.run, "launched_by_id", None), *approval.authors
    }


def approvals_of_operation(operation_id: str) -> list[Approval]:
    """Every request for one intent, newest first. For a caller that has already checked
    the user may see the operation (approval_for_user, operation_for_user)."""
    return list(
        Approval.objects.filter(operation_id=operation_id)
        .select_related("decided_by")
        .order_by("-id")
    )


@dataclass(frozen=True)
class QueueFilters:
    tenant: str = ""
    action: str = ""


def approvals_for_user(
    user, *, filters: QueueFilters, tenant_ids: list[int] | None = None
) -> QuerySet[Approval]:
    """`tenant_ids`: the user's visible tenants when the caller already read them."""
    if tenant_ids is None:
        tenant_ids = tenant_ids_for_user(user)
    qs = Approval.objects.filter(operation__tenant_id__in=tenant_ids)
    if filters.tenant:
        qs = qs.filter(operation__tenant__slug=filters.tenant)
    if filters.action:
        qs = qs.filter(operation__action=filters.action)
    return qs.select_related(
        "operation", "operation__tenant", "operation__run", "operation__run__launched_by",
        "operation__run__tenant", "operation__checkpoint", "operation__supersedes",
        "operation__superseded_by", "superseded_by__operation", "decided_by",
    ).prefetch_related(
        # Each card names the replaced intent's last approval request, whatever became of it
        # (superseded, rejected, expired): one query for the whole page.
        Prefetch(
            "operation__supersedes__approvals",
            queryset=Approval.objects.select_related("decided_by").order_by("-id"),
        )
    )


RECENT_DECISIONS = timedelta(hours=24)


def _pending_by_time(now: datetime) -> tuple[Q, Q]:
    """(waiting, ran out) among pending approvals. One that ran out can no longer be decided,
    but stays pending until the expiry sweep closes it (the beat is down or behind): it is
    counted apart, never as an intent waiting for a decision."""
    return Q(expires_at__gt=now), Q(expires_at__lte=now)


def approvals_waiting(user) -> dict[str, object]:
    """For the dashboard: how many intents wait for a person on the user's tenants and when
    the first of them expires, and how many ran out that the expiry sweep has not closed yet.
    The pending partial index; never the decided history."""
    waiting, ran_out = _pending_by_time(timezone.now())
    return Approval.objects.filter(
        operation__tenant_id__in=tenant_ids_for_user(user), status=P.PENDING
    ).aggregate(
        count=Count("id", filter=waiting),
        soonest=Min("expires_at", filter=waiting),
        overdue=Count("id", filter=ran_out),
    )


def approval_counts(qs: QuerySet[Approval]) -> list[tuple[str, str, int]]:
    """The whole pending queue, and the decisions of the last 24 hours. The decided history
    grows without end and the queue page polls this every 15 seconds, so it is never counted
    whole; both parts are index ranges (the pending partial index, recent decisions).
    Pending ones that ran out and are not closed yet are counted apart ("overdue"), when
    there are any, as the dashboard counts them."""
    now = timezone.now()
    waiting, ran_out = _pending_by_time(now)
    counts = (
        qs.filter(Q(status=P.PENDING) | Q(decided_at__gte=now - RECENT_DECISIONS))
        .order_by()
        .aggregate(
            **{
                status: Count("id", filter=Q(status=status) & (
                    waiting if status == P.PENDING else Q()
                ))
                for status in P.values
            },
            overdue=Count("id", filter=Q(status=P.PENDING) & ran_out),
        )
    )
    rows = [
        (status, label if status == P.PENDING else f"{label} (24 h)", counts[status])
        for status, label in P.choices
    ]
    if counts["overdue"]:
        rows.insert(1, ("overdue", "Expired, not yet closed", counts["overdue"]))
    return rows


def _cursor_for(approval: Approval) -> str:
    if approval.status == P.PENDING:
        return f"p|{approval.expires_at.isoformat()}|{approval.id}"
    return f"d|{approval.decided_at.isoformat()}|{approval.id}"


def _parse_cursor(cursor: str) -> tuple[str, datetime | None, str]:
    segment, _, rest = (cursor or "").partition("|")
    moment, _, last_id = rest.partition("|")
    try:
        when = parse_datetime(moment) if moment else None
    except ValueError:  # well-formed but impossible (February 30th): not ours, start over
        when = None
    if segment not in ("p", "d") or when is None or timezone.is_naive(when) or not last_id:
        return "", None, ""
    try:
        # In UTC, as the queue writes it: Python reads offsets up to ±23:59, PostgreSQL
        # holds ±15:59 only (a 500), and a moment past year 1 or 9999 in UTC is not ours.
        when = when.astimezone(UTC)
    except OverflowError:
        return "", None, ""
    return segment, when, last_id


def approvals_queue_page(
    qs: QuerySet[Approval], *, cursor: str = "", size: int = 20
) -> tuple[list[Approval], str | None]:
    """Pending first, soonest to expire first; then recent decisions, newest first.

    Keyset pagination over both segments: the cursor is the last row's (segment, time, id),
    so a page costs the same at any depth and a refresh of one page keeps its place.
    """
    segment, when, last_id = _parse_cursor(cursor)
    rows: list[Approval] = []
    if segment in ("", "p"):
        pending = qs.filter(status=P.PENDING).order_by("expires_at", "id")
        if segment == "p":
            pending = pending.filter(
                Q(expires_at__gt=when) | Q(expires_at=when, id__gt=last_id)
            )
        rows = list(pending[: size + 1])
    if len(rows) <= size:
        decided = qs.exclude(status=P.PENDING).order_by("-decided_at", "-id")
        if segment == "d":
            decided = decided.filter(
                Q(decided_at__lt=when) | Q(decided_at=when, id__lt=last_id)
            )
        rows += list(decided[: size + 1 - len(rows)])
    page = rows[:size]
    return page, (_cursor_for(page[-1]) if len(rows) > size else None)
