"""Property: no sequence of events makes two provider effects or changes payload_hash.

The provider here is an in-memory model of a Stripe-like API (same-key dedup, lookup by
operation id) whose faults Hypothesis chooses: a lost answer after commit, a 5xx before
commit, a 5xx the provider keeps for the key (as Stripe does once a request began to run), a
refusal, an inconclusive lookup. The engine, the database, the transition table and
the conditional updates are the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from operations import engine, transitions
from operations.models import Operation, OperationStatus
from operations.providers.base import (
    CallOutcome,
    CallResult,
    EffectClass,
    LookupMethod,
    LookupOutcome,
    LookupResult,
    ToolContract,
    WebhookFacts,
    request_fingerprint,
)
from tests.operations.engine_helpers import authorized_payment

S = OperationStatus

CONTRACT = ToolContract(
    provider="model", effect_class=EffectClass.IRREVERSIBLE, synchronous=True,
    lookup_methods=(LookupMethod.UNIQUE_FIELD,), key_retention=timedelta(hours=24),
    same_key_retry_safe=True,
)


@dataclass
class ProviderModel:
    contract: ToolContract = CONTRACT
    # Every effect created, in order: a create under a key not seen before makes a new one,
    # as at a real provider, so a second key would show here as a second effect.
    effects: list[dict] = field(default_factory=list)
    keys: dict[str, dict] = field(default_factory=dict)  # idempotency key -> its effect
    kept_5xx: set[str] = field(default_factory=set)  # keys whose kept answer is a 500
    call_faults: list[str] = field(default_factory=list)
    lookup_faults: list[str] = field(default_factory=list)
    log: list[tuple[str, str]] = field(default_factory=list)
    sent: list[tuple[str, str]] = field(default_factory=list)

    def account(self) -> str:
        return "acct_model"

    def call(self, op) -> CallResult:
        fault = self.call_faults.pop(0) if self.call_faults else "ok"
        params = dict(op.payload)
        self.sent.append((op.idempotency_key, request_fingerprint(params)))
        if op.idempotency_key in self.kept_5xx:
            self.log.append(("call", "replayed"))
            return CallResult(outcome=CallOutcome.UNKNOWN, error_class="replayed_5xx")
        if fault == "5xx_kept" and op.idempotency_key not in self.keys:
            self.kept_5xx.add(op.idempotency_key)
            self.log.append(("call", "unknown"))
            return CallResult(outcome=CallOutcome.UNKNOWN, error_class="http_5xx")
        if fault == "5xx_before_commit":
            self.log.append(("call", "unknown"))
            return CallResult(outcome=CallOutcome.UNKNOWN, error_class="http_5xx")
        if fault == "refused":
            self.log.append(("call", "failed"))
            return CallResult(outcome=CallOutcome.FAILED, error_class="validation")
        if op.idempotency_key not in self.keys:
            effect = {"id": f"pi_{len(self.effects) + 1}", "operation_id": op.id}
            self.effects.append(effect)
            self.keys[op.idempotency_key] = effect
        effect = self.keys[op.idempotency_key]
        if fault == "lost_after_commit":
            self.log.append(("call", "unknown"))
            return CallResult(outcome=CallOutcome.UNKNOWN, error_class="timeout")
        self.log.append(("call", "succeeded"))
        return CallResult(outcome=CallOutcome.SUCCEEDED, external_id=effect["id"])

    def lookup(self, op) -> LookupResult:
        fault = self.lookup_faults.pop(0) if self.lookup_faults else "truthful"
        if fault == "inconclusive":
            self.log.append(("lookup", "inconclusive"))
            return LookupResult(outcome=LookupOutcome.INCONCLUSIVE, reason="lookup timed out",
                                retry_after=timedelta(seconds=5))
        effect = self.effect_of(op.id)
        if effect is None:
            self.log.append(("lookup", "absent"))
            return LookupResult(outcome=LookupOutcome.ABSENT, method=LookupMethod.UNIQUE_FIELD)
        self.log.append(("lookup", "found"))
        return LookupResult(outcome=LookupOutcome.FOUND, method=LookupMethod.UNIQUE_FIELD,
                            status=CallOutcome.SUCCEEDED, external_id=effect["id"])

    def disagreement(self, *, payload, facts) -> str:
        return ""  # the model's one effect per operation is always the intent's

    def effect_of(self, operation_id: str) -> dict | None:
        return next((e for e in self.effects if e["operation_id"] == operation_id), None)


EVENTS = st.sampled_from([
    "execute", "execute", "expire_lease", "reconcile", "webhook_succeeded", "webhook_failed",
    "dispute", "resolve_failed",
])


@pytest.mark.django_db
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    events=st.lists(EVENTS, min_size=1, max_size=12),
    call_faults=st.lists(st.sampled_from(["ok", "lost_after_commit", "5xx_before_commit",
                                          "5xx_kept", "refused"]), max_size=6),
    lookup_faults=st.lists(st.sampled_from(["truthful", "inconclusive"]), max_size=6),
)
# Always tried, not left to chance: a retry after proven absence (same key, same params).
@example(events=["execute", "execute"], call_faults=["5xx_before_commit"], lookup_faults=[])
# And one retry only, where the key's kept answer is a 500 that every retry would get.
@example(events=["execute", "execute", "execute", "reconcile", "execute"],
         call_faults=["5xx_kept"], lookup_faults=[])
def test_it_never_makes_two_effects_or_changes_the_hash(
    acme, admin_user, monkeypatch, events, call_faults, lookup_faults
):
    provider = ProviderModel(call_faults=list(call_faults), lookup_faults=list(lookup_faults))
    monkeypatch.setattr("operations.engine.core.adapter", lambda action: provider)
    op = authorized_payment(acme, admin_user)
    original_hash = op.payload_hash
    seen: list[str] = [op.status]

    for n, event in enumerate(events):
        if event == "execute":
            engine.operation_execute(operation_id=op.id, worker=f"w{n}")
        elif event == "expire_lease":
            Operation.objects.filter(id=op.id, status=S.IN_PROGRESS).update(
                lease_expires_at=timezone.now() - timedelta(seconds=1))
        elif event == "reconcile":
            engine.operation_reconcile(operation_id=op.id)
        elif event.startswith("webhook_"):
            effect = provider.effect_of(op.id)
            if effect is None:
                continue  # a provider only reports on effects it has
            status = CallOutcome.SUCCEEDED if event.endswith("succeeded") else CallOutcome.FAILED
            engine.webhook_apply(provider="model", facts=WebhookFacts(
                event_id=f"evt_{op.id}_{n}", event_type=event, operation_id=op.id,
                external_id=effect["id"], status=status))
        elif event == "dispute":
            try:
                engine.operation_dispute(operation_id=op.id, actor=admin_user, reason="check")
            except engine.TransitionRefused:
                pass
        elif event == "resolve_failed":
            try:
                engine.operation_resolve(operation_id=op.id, actor=admin_user, outcome=S.FAILED,
                                         evidence_text="bank says no", reason="verified")
            except engine.TransitionRefused:
                pass
        op.refresh_from_db()
        if op.status != seen[-1]:
            assert (transitions.allowed(seen[-1], op.status)
                    or transitions.allowed(seen[-1], op.status, manual=True)
                    # the claim and the call result happen inside one execute
                    or (seen[-1] == S.NOT_STARTED
                        and transitions.allowed(S.IN_PROGRESS, op.status))), (seen[-1], op.status)
            seen.append(op.status)

    # At most one effect at the provider, and every call carried the same key and params.
    assert len(provider.effects) <= 1
    assert len(set(provider.sent)) <= 1
    assert op.payload_hash == original_hash
    assert Operation.objects.get(id=op.id).payload_hash == original_hash
    # An unknown outcome is never followed by a call unless a lookup proved absence first.
    last_result = None
    for kind, result in provider.log:
        if kind == "call" and last_result in (("call", "unknown"), ("call", "replayed")):
            pytest.fail(f"call after an unknown without a lookup: {provider.log}")
        if kind == "call" and last_result in (("lookup", "inconclusive"), ("lookup", "found")):
            pytest.fail(f"call after a lookup that did not prove absence: {provider.log}")
        last_result = (kind, result)
    # A key that answers with its kept 500 is never called again: it cannot succeed.
    calls = [result for kind, result in provider.log if kind == "call"]
    assert "replayed" not in calls[:-1], provider.log
    if op.status == S.SUCCEEDED and not op.resolved_manually:
        assert op.external_id == provider.effect_of(op.id)["id"]
