"""Prepare and authorize: the intent is recorded, and approved, before anything is called."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractUser
from django.db import transaction
from django.utils import timezone

from operations.engine.core import (
    AuthorizationRefused,
    S,
    execute_recheck_at,
    held_reports,
    transition,
)
from operations.ids import new_id
from operations.intents import (
    IDENTIFIER,
    IntentError,
    idempotency_key_for,
    intent_canonical,
    intent_validate,
    secret_in_text,
)
from operations.models import (
    Checkpoint,
    Evidence,
    EvidenceKind,
    Operation,
    Run,
    RunMode,
    Tenant,
)
from operations.policy import policy_for, policy_version_current
from operations.providers import adapter_for
from operations.providers.base import EffectClass, sandbox_endpoint
from operations.selectors import tenant_perm_held
from operations.services import audit_event_record
from operations.signals import operation_prepared


def operation_prepare(
    *,
    tenant: Tenant,
    action: str,
    payload: dict[str, Any],
    run: Run | None = None,
    checkpoint: Checkpoint | None = None,
    command_id: str = "",
    supersedes: Operation | None = None,
    actor: AbstractUser | None = None,
    author: AbstractUser | None = None,
) -> Operation:
    """Record the canonical intent before anything is called. Validates; never calls out.
    `author`: whose intent it is when no signed-in `actor` prepares it (the console account
    of a shell's user); four eyes keeps them from approving it.

    Preparing the same command of the same run again with the same intent returns the
    existing operation (a resumed node re-runs its code); a different intent for it must
    say which operation it supersedes.
    """
    payload = intent_validate(action=action, payload=payload)
    if problem := adapter_for(action).intent_problem(payload):
        raise IntentError(problem)
    # Lineage never crosses tenants: a run's page lists its operations, and must never show
    # another tenant's there.
    if run is not None and run.tenant_id != tenant.id:
        raise IntentError(f"run {run.id} belongs to another tenant")
    if checkpoint is not None and (run is None or checkpoint.run_id != run.id):
        raise IntentError(f"checkpoint {checkpoint.id} is not a checkpoint of the given run")
    if problem := run_mode_problem(run=run, action=action):
        raise IntentError(problem)
    limit = Operation._meta.get_field("command_id").max_length
    if len(command_id) > limit:
        # The caller's mistake, said as one: not a database error deep in the insert.
        raise IntentError(f"command id is longer than {limit} characters")
    if command_id and not IDENTIFIER.fullmatch(command_id):
        # Journaled and shown as it is, on the operation's page and by `operations show`.
        raise IntentError("command id must be an id: letters, digits and _ . : - only")
    if secret_in_text(command_id):
        raise IntentError("command id looks like card data or a secret; use the run's own id")
    if command_id and run is None:
        # A command's intent is found again only within its run (under the run's row lock):
        # taken alone, a retried prepare of the same command recorded a second intent.
        raise IntentError(
            f"command {command_id} is given without its run; a command is one of a run's, "
            "and only there is preparing it again the same intent (give the run too)"
        )
    policy = policy_for(action)
    canonical, payload_hash = intent_canonical(
        action=action, tenant=tenant.slug, payload=payload, policy_version=policy.version
    )
    with transaction.atomic():
        live = None
        if run is not None and command_id:
            # The run's row is the lock for its commands: two workers resuming the same node
            # at once would otherwise both find no operation for it and both insert one.
            # NO KEY: inserts that reference the run (its checkpoints, other operations)
            # take KEY SHARE for their foreign key, which a plain FOR UPDATE would block.
            Run.objects.select_for_update(no_key=True).filter(id=run.id).values_list(
                "id"
            ).first()
            # The command's current intent, cancelled ones included: a rejected intent
            # prepared again unchanged stays what it is (rejected), never a fresh request.
            live = (
                Operation.objects.select_for_update(of=("self",))
                .filter(run=run, command_id=command_id, superseded_by__isnull=True)
                .order_by("-id")
                .first()
            )
            if live is not None and supersedes is None:
                if live.payload_hash == payload_hash:
                    return live
                raise IntentError(
                    f"command {command_id} of {run.id} already has intent {live.id} with "
                    "another payload; a changed intent must supersede it"
                )
            if live is not None and supersedes.id != live.id:
                raise IntentError(
                    f"command {command_id} of {run.id} is at intent {live.id}; a changed "
                    f"intent supersedes that one, not {supersedes.id}"
                )
        if supersedes is not None:
            # The command's current intent is already locked above; any other, lock it here.
            if live is None:
                supersedes = Operation.objects.select_for_update().get(id=supersedes.id)
            else:
                supersedes = live
            if supersedes.tenant_id != tenant.id or supersedes.action != action:
                raise IntentError("a superseding intent keeps the tenant and the action")
            if (run is not None and supersedes.run_id != run.id) or (
                command_id and supersedes.command_id != command_id
            ):
                raise IntentError("a superseding intent keeps the run and the command")
            if hasattr(supersedes, "superseded_by"):
                raise IntentError(f"{supersedes.id} is already superseded")
            if supersedes.status not in (S.NOT_STARTED, S.FAILED, S.CANCELLED):
                raise IntentError(
                    f"{supersedes.id} is {supersedes.status}; only an intent that has not run, "
                    "or failed, can be superseded"
                )
            if supersedes.status == S.NOT_STARTED and supersedes.provider_calls:
                # Back in not_started after a lookup proved absence, to be called again with
                # its key: a call of it our client gave up on may still land. Cancelled here
                # and replaced by an intent with another key, that call would be a second
                # effect, under an operation that says it never ran.
                raise IntentError(
                    f"{supersedes.id} has made {supersedes.provider_calls} provider call(s) "
                    "that may still land; it runs again with its own key, and can be "
                    "superseded only once it has failed or been cancelled"
                )
            held = held_reports(supersedes.id).names()
            if held:
                # The provider reported an effect of it after it was closed (a payment that
                # settled after a person failed it, say), by an event or by the answer to a
                # call that came too late: replaced before a person looks, the new intent's
                # new key would make that effect a second time.
                raise IntentError(
                    f"{supersedes.id} has provider reports held for review "
                    f"({', '.join(held[:5])}): the provider may have carried it out after "
                    "all; a person decides (disputes or resolves it) before it is replaced"
                )
        operation_id = new_id("op")
        run_id = run.id if run else (supersedes.run_id if supersedes else "")
        requires = policy.requires_approval(payload)
        op = Operation.objects.create(
            id=operation_id,
            tenant=tenant,
            action=action,
            tool_name=action,
            payload=payload,
            canonical_intent=canonical,
            payload_hash=payload_hash,
            policy_version=policy.version,
            idempotency_key=idempotency_key_for(
                operation_id=operation_id,
                action=action,
                run_id=run_id or "",
                command_id=command_id or (supersedes.command_id if supersedes else ""),
            ),
            run=run or (supersedes.run if supersedes else None),
            checkpoint=checkpoint or (supersedes.checkpoint if supersedes else None),
            command_id=command_id or (supersedes.command_id if supersedes else ""),
            supersedes=supersedes,
            requires_approval=requires,
            created_by=actor or author,
        )
        audit_event_record(
            actor=actor,
            action="operation.prepare",
            tenant=tenant,
            object_type="operation",
            object_id=op.id,
            after={
                "action": action,
                "payload_hash": payload_hash,
                "policy_version": policy.version,
                "supersedes": supersedes.id if supersedes else None,
            },
        )
        if supersedes is not None and supersedes.status == S.NOT_STARTED:
            transition(
                supersedes,
                to=S.CANCELLED,
                sources={S.NOT_STARTED},
                evidence_kind=EvidenceKind.TRANSITION,
                summary=f"superseded by {op.id}",
                data={"superseded_by": op.id},
                actor=actor,
            )
        if not requires:
            # The policy itself authorizes; recorded like any other authorization.
            now = timezone.now()
            Operation.objects.filter(id=op.id).update(
                authorized_hash=payload_hash,
                authorized_policy_version=policy.version,
                authorized_at=now,
                authorization_expires_at=now + policy.approval_ttl,
                # Its caller executes it next; if that caller dies first, the sweep queues
                # it then, as for an approved one whose message was lost.
                next_reconcile_at=execute_recheck_at(now),
            )
            Evidence.objects.create(
                operation=op,
                kind=EvidenceKind.AUTHORIZATION,
                summary=f"authorized by policy {policy.version}: {policy.rule}",
                data={"policy_version": policy.version},
            )
        op.refresh_from_db()
        operation_prepared.send(sender=Operation, operation=op, supersedes=supersedes)
        return op


def operation_authorize(
    *,
    operation_id: str,
    approved_hash: str,
    policy_version: str,
    approved_by: AbstractUser,
    expires_at: datetime,
    reason: str = "",
) -> Operation:
    """Record that a person approved exactly this intent (hash) until `expires_at`."""
    with transaction.atomic():
        # OF self: a plain FOR UPDATE would lock the joined tenant row too, and hold every
        # insert of that tenant (its intents, audit rows) until this approval commits.
        op = (
            Operation.objects.select_for_update(of=("self",))
            .select_related("tenant")
            .get(id=operation_id)
        )
        if op.payload_hash != approved_hash:
            raise AuthorizationRefused(
                f"the approved hash {approved_hash[:19]}… is not this intent's "
                f"{op.payload_hash[:19]}…"
            )
        current = policy_version_current(op.action)
        if policy_version != op.policy_version or policy_version != current:
            raise AuthorizationRefused(
                f"policy {policy_version} is not current ({current}); "
                "the intent needs a new approval"
            )
        if expires_at <= timezone.now():
            raise AuthorizationRefused("the approval has expired")
        updated = Operation.objects.filter(
            id=op.id, status=S.NOT_STARTED, payload_hash=approved_hash, authorized_hash=""
        ).update(
            authorized_hash=approved_hash,
            authorized_policy_version=policy_version,
            authorized_by=approved_by,
            authorized_at=timezone.now(),
            authorization_expires_at=expires_at,
            # The approval queues the execute on commit; should that message be lost, the
            # sweep queues it again from this time on.
            next_reconcile_at=execute_recheck_at(timezone.now()),
        )
        if updated != 1:
            raise AuthorizationRefused(
                f"{op.id} is {op.status}{' and already authorized' if op.authorized_hash else ''}"
            )
        Evidence.objects.create(
            operation=op,
            kind=EvidenceKind.AUTHORIZATION,
            actor=approved_by,
            summary=f"approved by {getattr(approved_by, 'username', 'system')} "
            f"until {expires_at:%Y-%m-%d %H:%M} UTC",
            data={"approved_hash": approved_hash, "policy_version": policy_version},
        )
        audit_event_record(
            actor=approved_by,
            action="operation.authorize",
            tenant=op.tenant,
            object_type="operation",
            object_id=op.id,
            reason=reason,
            after={"approved_hash": approved_hash, "expires_at": expires_at.isoformat()},
        )
    op.refresh_from_db()
    return op


def run_mode_problem(
    *, run: Run | None, action: str, launcher_may: bool | None = None
) -> str:
    """Why the run's mode forbids calling `action` (empty when it allows it). A replay's
    runtime prepares its nodes' commands again in the new run, under new keys that the
    provider dedups nothing against: what the original run already paid would be paid twice.
    So an evidence replay calls nothing, a simulation only this console's sandbox, and a live
    replay makes irreversible effects only when whoever launched it may. `launcher_may`:
    whether the launcher holds replay_live_irreversible on the run's tenant, when the caller
    read it for a whole page of runs at once; read here when None."""
    if run is None or run.mode in (RunMode.ORIGINAL, RunMode.BRANCH):
        return ""
    if run.mode == RunMode.EVIDENCE:
        return (f"run {run.id} is an evidence replay: it replays recorded outputs and calls "
                "no provider")
    adapter = adapter_for(action)
    if run.mode == RunMode.SIMULATION:
        if sandbox_endpoint(adapter.endpoint()):
            return ""
        return (f"run {run.id} is a simulation: it calls this console's sandbox providers "
                f"only, and {adapter.contract.provider} requests go to another endpoint")
    if adapter.contract.effect_class != EffectClass.IRREVERSIBLE:
        return ""
    launcher = run.launched_by
    if launcher_may is None:
        launcher_may = launcher is not None and tenant_perm_held(
            launcher, "replay_live_irreversible", run.tenant
        )
    if launcher is not None and launcher_may:
        return ""
    who = launcher.get_username() if launcher is not None else "no one named"
    return (f"run {run.id} is a live replay launched by {who}, who may not make an "
            f"irreversible effect ({action}) in a replay")


def call_problem(op: Operation) -> tuple[str, str]:
    """(error code, why) when the operation may not be called now, its authorization, its
    run's mode or its provider's contract forbidding it; ("", "") when it may."""
    if problem := authorization_problem(op):
        return "authorization", problem
    if problem := run_mode_problem(run=op.run, action=op.action):
        return "run_mode", problem
    # Checked at prepare, and again here: an intent prepared before the adapter knew a limit
    # (an amount over Stripe's eight digits) could only be refused by the provider.
    if problem := adapter_for(op.action).intent_problem(op.payload):
        return "intent", problem
    return "", ""


def authorization_problem(op: Operation) -> str:
    if not op.authorized_hash:
        return "missing"
    if op.authorized_hash != op.payload_hash:
        return "the authorization is for another intent (hash mismatch)"
    current = policy_version_current(op.action)
    if op.authorized_policy_version != op.policy_version or op.policy_version != current:
        return f"policy {op.policy_version} is no longer current ({current})"
    if op.authorization_expires_at is None or op.authorization_expires_at <= timezone.now():
        return "the authorization has expired"
    return ""
