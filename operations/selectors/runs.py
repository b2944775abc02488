"""Reads about a run's lineage, within its tenant (lineage never shows another's runs)."""

from __future__ import annotations

from operations.models import Operation, OperationStatus, Run

S = OperationStatus

# Closed with no effect at the provider: refused by it, or never called. Every other status
# made its effect, may have, or may yet: one waiting for its approval, approved and queued,
# or back before a new call once a lookup proved the last left nothing.
_CLOSED_WITHOUT_EFFECT = (S.FAILED, S.CANCELLED)


def run_ancestors(run: Run, *, limit: int = 50) -> list[str]:
    """Ids of the parent, grandparent, … oldest last; bounded so a corrupt cycle cannot hang
    a page. One small id read per generation: lineages are a few runs deep."""
    chain: list[str] = []
    parent_id = run.parent_run_id
    same_tenant = Run.objects.filter(tenant_id=run.tenant_id)
    while parent_id and len(chain) < limit:
        parent = same_tenant.filter(id=parent_id).values("parent_run_id").first()
        if parent is None:
            break
        chain.append(parent_id)
        parent_id = parent["parent_run_id"]
    return chain


def command_effects_in_runs(op: Operation, *, run_ids: list[str]) -> list[Operation]:
    """The same command's operations in `run_ids` (the runs this operation's run was
    replayed or branched from, nearest first: `run_ancestors`) that made their effect, may
    have, or may yet. A replay prepares its nodes' commands again under new keys, which the
    provider dedups nothing against: approving one of those makes the effect a second time,
    and so does approving both of two still waiting. In the order of `run_ids`."""
    if not op.command_id or not run_ids:
        return []
    found = Operation.objects.filter(
        tenant_id=op.tenant_id, run_id__in=run_ids, command_id=op.command_id,
    ).exclude(status__in=_CLOSED_WITHOUT_EFFECT)
    nearness = {run_id: n for n, run_id in enumerate(run_ids)}
    return sorted(found, key=lambda earlier: (nearness[earlier.run_id], earlier.id))
