from __future__ import annotations

from datetime import timedelta

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from operations.engine.core import call_reach_until, lease_duration
from operations.models import Attempt, AttemptKind, Tenant

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
    started_at = factory.LazyFunction(timezone.now)
    reach_until = factory.LazyAttribute(
        lambda o: call_reach_until(o.started_at + lease_duration())
        if o.timeout is None
        else o.started_at + lease_duration() + timedelta(seconds=o.timeout)
    )
