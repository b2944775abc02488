"""`make bench`: the numbers the engine and the journal are held to, in one run.

1. Operations executed end to end per second: prepared and authorized intents, executed by
   real Celery workers (threads pool and DEBUG off, as deployed) against the sandbox
   payments provider served by gunicorn over HTTP (target: at least 200/s on a 2-core
   machine).
   Then the same payment creates sent straight to the sandbox by a bare HTTP client: the
   provider stand-in's own cost on these cores, which the end-to-end figure includes.
2. `pgbench -N` transactions per second on the same PostgreSQL, for scale.
3. The journal list page's server time and query count at 1,000 and at 1,000,000
   operations (target: under 100 ms, and the same query count at both sizes).

Runs in its own databases (console_bench, console_pgbench) on whatever server
DATABASE_URL (or the embedded one) names; never touches the console's own data.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent
BENCH_DB = "console_bench"
PGBENCH_DB = "console_pgbench"
E2E_OPERATIONS = int(os.environ.get("BENCH_OPERATIONS", "1000"))
E2E_WARMUP = int(os.environ.get("BENCH_WARMUP", "200"))
JOURNAL_ROWS = int(os.environ.get("BENCH_JOURNAL_ROWS", "1000000"))


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _base_url() -> str:
    from console.env import read_config

    return read_config(os.environ).database_url


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _recreate_database(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_with_database(url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()


def _wait_http(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


CpuSnapshot = dict[str, dict[int, float]]


def _cpu_seconds(procs: list[subprocess.Popen]) -> CpuSnapshot | None:
    """CPU seconds used so far by each process, by kind (psutil, when installed)."""
    try:
        import psutil
    except ImportError:
        return None

    def seconds(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    def tree(pid: int) -> dict[int, float]:
        found: dict[int, float] = {}
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = seconds(proc)
        except psutil.Error:
            pass
        return found

    servers: CpuSnapshot = {"postgres": {}, "redis": {}}
    for proc in psutil.process_iter(["name"]):
        name = proc.info["name"] or ""
        kind = "postgres" if name.startswith("postgres") else "redis" if "redis" in name else ""
        if kind:
            try:
                servers[kind][proc.pid] = seconds(proc)
            except psutil.Error:
                pass
    own = psutil.Process()
    return {"sandbox (gunicorn)": tree(procs[0].pid), "worker (celery)": tree(procs[1].pid),
            **servers, "bench": {own.pid: seconds(own)}}


def _cpu_used(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds each kind used between two snapshots, counted per process: a database
    backend that ends meanwhile (a connection past CONN_MAX_AGE is replaced) must not take
    its whole life's CPU off the total. What such a process used after `before` is missed,
    so these are lower bounds."""
    return {
        kind: sum(used - before[kind].get(pid, 0.0) for pid, used in after[kind].items())
        for kind in before
    }


def _authorized_payments(tenant, count: int) -> list[str]:
    from tests.operations.engine_helpers import authorized_payment

    return [
        authorized_payment(tenant, invoice_id=f"inv_{i}", beneficiary_id=f"vendor_{i % 97}",
                           amount_minor=1000 + i, currency="EUR").id
        for i in range(count)
    ]


def _execute_and_wait(tenant, ids: list[str], queue: str) -> tuple[int, float]:
    """Enqueue every execute and wait until all have left not_started / in_progress;
    (how many did, seconds from the first enqueue)."""
    from operations.models import Operation, OperationStatus
    from operations.tasks import execute_operation

    started = time.perf_counter()
    for operation_id in ids:
        execute_operation.apply_async(args=[operation_id], queue=queue)
    deadline = time.monotonic() + 600
    done = 0
    while time.monotonic() < deadline:
        # The tenant holds exactly these operations (fresh database): counting by tenant
        # keeps the poll cheap, where 20 queries a second each carrying every id cost the
        # measured machine ~4 ms CPU per operation.
        done = Operation.objects.filter(tenant=tenant).exclude(
            status__in=[OperationStatus.NOT_STARTED, OperationStatus.IN_PROGRESS]
        ).count()
        if done == len(ids):
            break
        time.sleep(0.05)
    return done, time.perf_counter() - started


def bench_end_to_end(env: dict[str, str]) -> tuple[float, float]:
    """(operations per second end to end, sandbox payment creates per second alone)."""
    from django.conf import settings
    from django.db.models import Count

    from console.tasks import ping
    from operations.models import Operation
    from operations.sandbox.models import PaymentIntent
    from operations.services import tenant_create

    port = _free_port()
    queue = f"bench-{os.getpid()}"
    child_env = {
        **env,
        "CELERY_QUEUE": queue,
        "PAYMENTS_API_BASE": f"http://127.0.0.1:{port}/sandbox/payments",
        "SANDBOX_ENABLED": "1",
        "LOG_LEVEL": "WARNING",
        # Measured as deployed: DEBUG on would wrap every cursor to record its SQL.
        "DEBUG": "0",
        "SECRET_KEY": "bench-" + "k" * 60,
        "ALLOWED_HOSTS": "127.0.0.1",
        "SECURE_SSL_REDIRECT": "0",
        # With DEBUG off an unset sandbox key is derived from SECRET_KEY; the provider-alone
        # client (this process, DEBUG on) must send the same one.
        "PAYMENTS_API_KEY": settings.PAYMENTS_API_KEY,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "console.wsgi", "--bind", f"127.0.0.1:{port}",
             "--workers", os.environ.get("BENCH_GUNICORN_WORKERS", "3"),
             "--threads", os.environ.get("BENCH_GUNICORN_THREADS", "4"),
             "--worker-class", "gthread",
             "--log-level", "warning"],
            cwd=BASE_DIR, env=child_env, start_new_session=True,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", queue,
             "--concurrency", os.environ.get("BENCH_WORKER_CONCURRENCY", "8"),
             "--pool", os.environ.get("BENCH_WORKER_POOL", "threads"),
             # The deployed prefetch (settings: 1); 4 measured the same here.
             "--loglevel", "WARNING", "--without-gossip", "--without-mingle"],
            cwd=BASE_DIR, env=child_env, start_new_session=True,
        ),
    ]
    try:
        from console.celery import app

        app.conf.task_default_queue = queue
        _wait_http(f"http://127.0.0.1:{port}/healthz")
        ping.apply_async(queue=queue).get(timeout=60)
        # Start-up costs are not per-operation costs: each gunicorn process imports the
        # URLconf on its first request, and every worker and gunicorn thread opens its own
        # database connection on first use. A warm-up batch pays them before the clock runs.
        warm_tenant = tenant_create(slug="bench-warmup", name="Bench warm-up",
                                    legal_entity="Bench LLP")
        _execute_and_wait(warm_tenant, _authorized_payments(warm_tenant, E2E_WARMUP), queue)
        say(f"end to end: {E2E_WARMUP} warm-up operations executed (not measured)")
        tenant = tenant_create(slug="bench", name="Bench", legal_entity="Bench LLP")
        ids = _authorized_payments(tenant, E2E_OPERATIONS)
        say(f"end to end: {len(ids)} authorized payments prepared; executing")
        payments_before = PaymentIntent.objects.count()
        cpu_before = _cpu_seconds(procs)
        done, elapsed = _execute_and_wait(tenant, ids, queue)
        cpu_after = _cpu_seconds(procs)
        statuses = dict(Operation.objects.filter(tenant=tenant).values_list("status").annotate(
            n=Count("id")))
        payments = PaymentIntent.objects.count() - payments_before
        rate = done / elapsed
        say(f"end to end: {done} operations in {elapsed:.2f}s = {rate:.0f} ops/s "
            f"(target >= 200/s); statuses {statuses}; sandbox payments {payments}")
        if cpu_before and cpu_after and done:
            used = _cpu_used(cpu_before, cpu_after)
            say("end to end: CPU ms per operation: " + ", ".join(
                f"{kind} {used[kind] / done * 1000:.1f}" for kind in used if kind != "bench")
                + f", bench (enqueue, poll) {used['bench'] / done * 1000:.1f}")
            # What the cores allow at that cost, whatever the concurrency: the rate above is
            # read against it (waiting and idle cores lower it, more cores raise it).
            per_op = sum(used.values()) / done
            cores = len(os.sched_getaffinity(0))
            say(f"end to end: {per_op * 1000:.1f} ms of CPU per operation in all; {cores} "
                f"cores allow at most {cores / per_op:.0f} ops/s at that cost")
            e2e_cpu = {kind: seconds / done for kind, seconds in used.items()}
        else:
            e2e_cpu = None
        if payments != E2E_OPERATIONS:
            say(f"WARNING: {payments} payments for {E2E_OPERATIONS} operations")
        alone = bench_provider_alone(port, procs, e2e_cpu=e2e_cpu)
        return rate, alone
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def bench_provider_alone(
    port: int, procs: list[subprocess.Popen], *, e2e_cpu: dict[str, float] | None
) -> float:
    """The same payment creates sent straight to the sandbox by a bare HTTP client: what the
    provider stand-in alone costs these two cores, without our worker or journal. With the
    end-to-end run's CPU per operation (`e2e_cpu`, seconds by kind), also what our side alone
    costs: the worker, and PostgreSQL less the provider's share of it."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    url = f"http://127.0.0.1:{port}/sandbox/payments/v1/payment_intents"
    from django.conf import settings

    headers = {"Authorization": f"Bearer {settings.PAYMENTS_API_KEY}"}
    count = E2E_OPERATIONS

    def create(client: httpx.Client, i: int) -> int:
        return client.post(url, headers={**headers, "Idempotency-Key": f"ik_alone_{i}"}, data={
            "amount": 1000 + i, "currency": "eur", "confirm": "true",
            "payment_method": settings.PAYMENTS_PAYMENT_METHOD,
            "automatic_payment_methods[enabled]": "true",
            "automatic_payment_methods[allow_redirects]": "never",
            "metadata[operation_id]": f"op_alone_{i}"}).status_code

    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=8)) as client:
        cpu_before = _cpu_seconds(procs)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=8) as pool:
            codes = list(pool.map(lambda i: create(client, i), range(count)))
        elapsed = time.perf_counter() - started
        cpu_after = _cpu_seconds(procs)
    ok = codes.count(200)
    say(f"provider alone: {ok} sandbox payment creates in {elapsed:.2f}s = "
        f"{ok / elapsed:.0f} requests/s from a bare client (no worker, no journal)")
    if cpu_before and cpu_after and ok:
        used = _cpu_used(cpu_before, cpu_after)
        say("provider alone: CPU ms per request: " + ", ".join(
            f"{kind} {used[kind] / ok * 1000:.1f}"
            for kind in ("sandbox (gunicorn)", "postgres", "redis"))
            + f", the client {used['bench'] / ok * 1000:.1f}")
        if e2e_cpu:
            # A real provider's CPU is never on our cores. The provider's PostgreSQL work per
            # create is the same whoever sends it, so ours is the end-to-end share less that.
            ours_pg = max(e2e_cpu["postgres"] - used["postgres"] / ok, 0.0)
            ours = e2e_cpu["worker (celery)"] + ours_pg
            cores = len(os.sched_getaffinity(0))
            say(f"our side alone: worker {e2e_cpu['worker (celery)'] * 1000:.1f} ms + its "
                f"PostgreSQL {ours_pg * 1000:.1f} ms of CPU per operation; with the provider "
                f"on other machines, {cores} cores would allow at most {cores / ours:.0f} "
                "ops/s (an estimate)")
    return ok / elapsed


def bench_pgbench(url: str) -> float | None:
    binary = shutil.which("pgbench")
    try:
        import pgserver

        bundled = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench"
        if bundled.exists():
            binary = str(bundled)
    except ImportError:
        pass
    if not binary:
        say("pgbench: not found on this machine (install postgresql-client)")
        return None
    _recreate_database(url, PGBENCH_DB)
    parts = urlsplit(_with_database(url, PGBENCH_DB))
    host = parts.hostname or parse_qs(parts.query).get("host", [""])[0]
    args = ["-h", host, "-U", parts.username or "postgres"]
    if parts.port:
        args += ["-p", str(parts.port)]
    env = {**os.environ, "PGPASSWORD": parts.password or ""}
    subprocess.run([binary, "-i", "-s", "10", "-q", *args, PGBENCH_DB], check=True, env=env,
                   capture_output=True)
    out = subprocess.run([binary, "-N", "-c", "4", "-j", "2", "-T", "10", *args, PGBENCH_DB],
                         check=True, env=env, capture_output=True, text=True).stdout
    tps = next(float(line.split("=")[1].split()[0]) for line in out.splitlines()
               if line.startswith("tps ="))
    say(f"pgbench -N -c 4 -T 10: {tps:.0f} tps on the same server")
    return tps


JOURNAL_PATHS = (
    "/operations/", "/operations/?status=unknown", "/operations/?action=payments.create",
)


def _page_timing(
    client, label: str, *, page: str = "journal list", paths: tuple[str, ...] = JOURNAL_PATHS,
    target: str = " (target < 100 ms)",
) -> tuple[float, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(paths[0])  # warm caches and connections
    times = []
    queries = 0
    for path in paths:
        for _ in range(7):
            with CaptureQueriesContext(connection) as ctx:
                started = time.perf_counter()
                response = client.get(path)
                times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, response.status_code
            queries = max(queries, len(ctx.captured_queries))
    median = statistics.median(times)
    say(f"{page} at {label}: median {median:.1f} ms, p95 "
        f"{statistics.quantiles(times, n=20)[-1]:.1f} ms, {queries} queries{target}")
    return median, queries


def _insert_operations(tenant_ids: list[int], count: int, start: int) -> None:
    """Rows of the given tenants interleaved in time, as ULID ids of a shared journal are."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO operations_operation (
                id, tenant_id, action, tool_name, payload, canonical_intent, payload_hash,
                policy_version, idempotency_key, command_id, requires_approval, created_at,
                authorized_hash, authorized_policy_version, status, status_changed_at,
                lease_owner, external_id, provider_request_id, error_code, error_message,
                resolved_manually, provider_calls, unknown_since
            )
            SELECT 'op_00' || lpad(i::text, 24, '0'), (%s::bigint[])[1 + i %% %s],
                   'payments.create',
                   'payments.create',
                   jsonb_build_object('invoice_id', 'inv_' || i, 'beneficiary_id', 'vendor_'
                       || (i %% 97), 'amount_minor', 1000 + i, 'currency', 'EUR'),
                   '{}', 'sha256:' || md5(i::text) || md5((i + 1)::text), 'payments-v3',
                   'ik_bench_' || i, '', true, now() - (i || ' seconds')::interval,
                   '', '', s.status, now(), '', 'pi_' || i, '', '', '', false, 1,
                   CASE WHEN s.status = 'unknown' THEN now() END
            FROM generate_series(%s, %s) AS i,
                 LATERAL (SELECT (ARRAY['succeeded', 'succeeded', 'succeeded', 'failed',
                                        'unknown', 'not_started', 'cancelled'])[1 + i %% 7]
                                 AS status) AS s
            """,
            [tenant_ids, len(tenant_ids), start, start + count - 1],
        )
        # As autovacuum leaves a journal soon after a bulk of inserts (PostgreSQL 13 and
        # later vacuum on inserts too): counted from its visibility map, not every row.
        cursor.execute("VACUUM ANALYZE operations_operation")


Timing = tuple[float, int]


def bench_journal() -> tuple[Timing, Timing, Timing, Timing]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from console.roles import role_grant, roles_setup
    from operations.services import tenant_create

    roles_setup()
    tenant = tenant_create(slug="journal", name="Journal", legal_entity="Journal LLP")
    other = tenant_create(slug="journal-other", name="Other", legal_entity="Other LLP")
    user, _ = get_user_model().objects.get_or_create(username="bench-operator")
    role_grant(user=user, role="Operator", tenant=tenant)
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)

    _insert_operations([tenant.id], 1000, 1)
    small = _page_timing(client, "1,000 operations")
    # The landing page counts a tenant's operations by status: no target in the issue, but a
    # person opens it first, so its growth with the journal is printed beside the list's.
    dashboard_small = _page_timing(client, "1,000 operations", page="dashboard", paths=("/",),
                                   target="")
    say(f"journal: inserting {JOURNAL_ROWS:,} operations (two tenants)…")
    started = time.perf_counter()
    _insert_operations([tenant.id, other.id], JOURNAL_ROWS - 1000, 1001)
    say(f"journal: inserted in {time.perf_counter() - started:.0f}s")
    large = _page_timing(client, f"{JOURNAL_ROWS:,} operations")
    dashboard_large = _page_timing(client, f"{JOURNAL_ROWS:,} operations", page="dashboard",
                                   paths=("/",), target="")
    verdict = "same" if small[1] == large[1] else "DIFFERENT"
    say(f"journal: query count {small[1]} at 1,000 and {large[1]} at {JOURNAL_ROWS:,} ({verdict})")
    return small, large, dashboard_small, dashboard_large


def main() -> int:
    # This process prepares the operations and renders the journal pages through Django's
    # test client (unbuilt static manifest, the test host name): development settings. The
    # measured worker and provider processes run with DEBUG off.
    os.environ.setdefault("DEBUG", "1")
    base_url = _base_url()
    say(f"server: {urlsplit(base_url).hostname or parse_qs(urlsplit(base_url).query).get('host')}")
    _recreate_database(base_url, BENCH_DB)
    bench_url = _with_database(base_url, BENCH_DB)
    env = {**os.environ, "DATABASE_URL": bench_url, "DEBUG": "1"}
    subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
                   cwd=BASE_DIR, env=env, check=True)
    _setup_django(bench_url)
    rate, alone = bench_end_to_end(env)
    if os.environ.get("BENCH_E2E_ONLY"):  # for iterating on the engine: the first measure only
        return 0
    tps = bench_pgbench(base_url)
    small, large, dashboard_small, dashboard_large = bench_journal()
    say("summary:")
    say(f"  end to end          {rate:8.0f} ops/s   (target >= 200)")
    say(f"  provider alone      {alone:8.0f} req/s   (the sandbox's own ceiling here)")
    if tps is not None:
        say(f"  pgbench -N          {tps:8.0f} tps")
    say(f"  journal @1k         {small[0]:8.1f} ms   {small[1]} queries")
    label = f"journal @{JOURNAL_ROWS // 1000}k"
    say(f"  {label:<19} {large[0]:8.1f} ms   {large[1]} queries (target < 100 ms, same count)")
    say(f"  dashboard @1k       {dashboard_small[0]:8.1f} ms   {dashboard_small[1]} queries")
    label = f"dashboard @{JOURNAL_ROWS // 1000}k"
    say(f"  {label:<19} {dashboard_large[0]:8.1f} ms   {dashboard_large[1]} queries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
