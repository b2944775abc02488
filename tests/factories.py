from __future__ import annotations

from datetime import timedelta

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from operations.engine.core import adapter, call_reach_until, lease_duration
from operations.models import Attempt, AttemptKind, Checkpoint, Run, RunMode, Tenant

PASSWORD = "correct horse battery staple"


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"tenant{n}")
    name = factory.LazyAttribute(lambda o: o.slug.title())
    legal_entity = factory.LazyAttribute(lambda o: f"{o.slug.title()} LLP")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")

    @factory.post_generation
    def password(obj, create, extracted, **kwargs):
        obj.set_password(extracted or PASSWORD)
        if create:
            obj.save(update_fields=["password"])


class CallAttemptFactory(factory.django.DjangoModelFactory):
    """A provider call as execute records it: its reach is what a lease of today's length
    from `started_at` and the client's timeout give it (`timeout`: a call made under
    another one, as an earlier release's)."""

    class Meta:
        model = Attempt

    class Params:
        timeout = None

    number = 1
    kind = AttemptKind.CALL
    worker = "w"
    idempotency_key = factory.LazyAttribute(lambda o: o.operation.idempotency_key)
    provider_account = factory.LazyAttribute(lambda o: adapter(o.operation.action).account())
    started_at = factory.LazyFunction(timezone.now)
    reach_until = factory.LazyAttribute(
        lambda o: call_reach_until(o.started_at + lease_duration())
        if o.timeout is None
        else o.started_at + lease_duration() + timedelta(seconds=o.timeout)
    )


class RunFactory(factory.django.DjangoModelFactory):
    """An original run; `derived_from=<checkpoint>` makes a replay or branch of its run."""

    class Meta:
        model = Run

    class Params:
        derived_from = None

    conversation_id = factory.LazyAttributeSequence(
        lambda o, n: o.derived_from.run.conversation_id if o.derived_from else f"conv_{n:06d}")
    tenant = factory.Maybe(
        "derived_from",
        yes_declaration=factory.LazyAttribute(lambda o: o.derived_from.run.tenant),
        no_declaration=factory.SubFactory(TenantFactory),
    )
    workflow_name = "pay_invoices"
    workflow_version = 7
    state_schema_version = 4
    mode = factory.LazyAttribute(
        lambda o: RunMode.ORIGINAL if o.derived_from is None else RunMode.BRANCH)
    parent_checkpoint = factory.LazyAttribute(lambda o: o.derived_from)
    parent_run = factory.LazyAttribute(lambda o: o.derived_from and o.derived_from.run)
    launch_reason = factory.LazyAttribute(
        lambda o: "" if o.derived_from is None else "reproduce the lost answer")


class CheckpointFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Checkpoint

    run = factory.SubFactory(RunFactory)
    sequence = factory.Sequence(lambda n: n + 1)
    node = "prepare_payment"
    state = factory.LazyFunction(lambda: {"invoice": "inv_9182"})
    state_hash = "sha256:" + "a" * 64
