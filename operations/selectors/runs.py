"""Reads about a run's lineage, within its tenant (lineage never shows another's runs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import reduce
from operator import or_

from django.db import connection
from django.db.models import Q

from operations.models import Operation, OperationStatus, Run, nothing_held_for_review

S = OperationStatus

# Closed with no effect at the provider: refused by it, or never called. Every other status
# made its effect, may have, or may yet: one waiting for its approval, approved and queued,
# or back before a new call once a lookup proved the last left nothing. A closed one whose
# provider reported the effect after all (an event or a late answer held for review) is no
# longer closed without effect until a person answers that report: the payment may have
# settled after a person failed it, as prepare's refusal to replace such an intent knows.
_CLOSED_WITHOUT_EFFECT = (S.FAILED, S.CANCELLED)

# Each generation joins the next through a parent of the same tenant as the run the walk
# started from: a parent elsewhere ends the walk there, as it ends the run page's chain.
# UNION ALL with a depth counter rather than UNION: a corrupt cycle is cut by the bound, and
# reads as the walk one generation at a time read it.
_ANCESTORS_SQL = """
WITH RECURSIVE chain (origin_id, tenant_id, run_id, parent_run_id, depth) AS (
    SELECT start.id, start.tenant_id, parent.id, parent.parent_run_id, 1
      FROM {run} start
      JOIN {run} parent
        ON parent.id = start.parent_run_id AND parent.tenant_id = start.tenant_id
     WHERE start.id = ANY(%s)
    UNION ALL
    SELECT chain.origin_id, chain.tenant_id, parent.id, parent.parent_run_id, chain.depth + 1
      FROM chain
      JOIN {run} parent
        ON parent.id = chain.parent_run_id AND parent.tenant_id = chain.tenant_id
     WHERE chain.depth < %s
)
SELECT origin_id, run_id FROM chain ORDER BY origin_id, depth
"""


def runs_ancestors(runs: Iterable[Run], *, limit: int = 50) -> dict[str, list[str]]:
    """For each run, by id, the ids of its parent, grandparent, … oldest last; bounded so a
    corrupt cycle cannot hang a page. One query for all of them (a recursive CTE), so a page
    of derived runs' intents costs what one does; a run with no parent costs none."""
    runs = list(runs)
    ancestors: dict[str, list[str]] = {run.id: [] for run in runs}
    derived = [run.id for run in runs if run.parent_run_id]
    if not derived or limit < 1:
        return ancestors
    sql = _ANCESTORS_SQL.format(run=connection.ops.quote_name(Run._meta.db_table))
    with connection.cursor() as cursor:
        cursor.execute(sql, [derived, limit])
        for origin_id, run_id in cursor.fetchall():
            ancestors[origin_id].append(run_id)
    return ancestors


def run_ancestors(run: Run, *, limit: int = 50) -> list[str]:
    """Ids of the parent, grandparent, … oldest last, within the run's tenant: `runs_ancestors`
    of this one run."""
    return runs_ancestors([run], limit=limit)[run.id]


def command_effects_in_runs(
    ops: Sequence[Operation], *, run_ids: Mapping[str, Sequence[str]]
) -> dict[str, list[Operation]]:
    """For each operation, by id, the same command's operations in `run_ids[op.id]` (the runs
    its run was replayed or branched from, nearest first: `runs_ancestors`) that made their
    effect, may have, or may yet. A replay prepares its nodes' commands again under new keys,
    which the provider dedups nothing against: approving one of those makes the effect a
    second time, and so does approving both of two still waiting. In the order of its
    `run_ids`. Each is annotated `nothing_held`: false when the provider reported an effect
    of it that waits for a person (`held_reports`). One query for all of them."""
    asked = [op for op in ops if op.command_id and run_ids.get(op.id)]
    effects: dict[str, list[Operation]] = {op.id: [] for op in ops}
    if not asked:
        return effects
    found = list(
        Operation.objects.filter(reduce(or_, (
            Q(tenant_id=op.tenant_id, run_id__in=run_ids[op.id], command_id=op.command_id)
            for op in asked
        )))
        .annotate(nothing_held=nothing_held_for_review())
        .filter(~Q(status__in=_CLOSED_WITHOUT_EFFECT) | Q(nothing_held=False))
    )
    for op in asked:
        nearness = {run_id: n for n, run_id in enumerate(run_ids[op.id])}
        effects[op.id] = sorted(
            (
                earlier for earlier in found
                if earlier.tenant_id == op.tenant_id and earlier.run_id in nearness
                and earlier.command_id == op.command_id
            ),
            key=lambda earlier, nearness=nearness: (nearness[earlier.run_id], earlier.id),
        )
    return effects
