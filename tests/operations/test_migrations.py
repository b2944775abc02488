from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from operations.models import Operation
from tests.operations.engine_helpers import authorized_payment, prepared_payment


@pytest.mark.django_db(transaction=True)
def test_it_gives_operations_left_waiting_before_0007_a_recheck(acme, approver):
    executor = MigrationExecutor(connection)
    executor.migrate([("operations", "0006_tenant_role")])
    try:
        waiting = authorized_payment(acme, approver)  # approved, never claimed
        fresh = prepared_payment(acme, invoice_id="inv_fresh")  # not approved: not waiting
        Operation.objects.filter(id__in=[waiting.id, fresh.id]).update(next_reconcile_at=None)

        executor.loader.build_graph()
        executor.migrate([("operations", "0007_recheck_waiting_operations")])

        assert Operation.objects.get(id=waiting.id).next_reconcile_at is not None
        assert Operation.objects.get(id=fresh.id).next_reconcile_at is None
    finally:
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
