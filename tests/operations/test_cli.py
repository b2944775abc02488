from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from operations.models import Attempt, AttemptKind, AuditEvent, Operation, Run
from tests.conftest import BASE_DIR, database_url
from tests.factories import CallAttemptFactory
from tests.operations.engine_helpers import PAYMENT, make_unknown, prepared_payment


def prepare_args(
    payload: dict | str = PAYMENT, *, tenant: str = "acme", action: str = "payments.create",
    extra: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """`operations prepare` arguments; a str payload is passed as it is (bad JSON, say)."""
    raw = payload if isinstance(payload, str) else json.dumps(payload)
    return ("prepare", "--tenant", tenant, "--action", action, "--payload", raw, *extra)


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command("operations", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_it_prepares_and_prints_only_the_new_operation_id(acme):
    err = io.StringIO()
    out = io.StringIO()
    call_command("operations", *prepare_args(), stdout=out, stderr=err)
    out = out.getvalue()
    op = Operation.objects.get()
    assert out == f"{op.id}\n" and err.getvalue() == ""  # awaits a person: nothing to add
    assert op.status == "not_started" and op.payload == PAYMENT
    assert AuditEvent.objects.filter(action="operation.prepare", object_id=op.id).count() == 1


@pytest.mark.django_db
def test_it_says_on_stderr_when_the_policy_authorized_the_intent(acme):
    out, err = io.StringIO(), io.StringIO()
    call_command("operations", *prepare_args(
        {"to": "anna@example.com", "template": "receipt", "params": {}}, action="mail.send"
    ), stdout=out, stderr=err)
    op = Operation.objects.get()
    assert out.getvalue() == f"{op.id}\n"  # scripts still read the bare id
    assert "authorized by policy" in err.getvalue()
    assert f"operations execute {op.id}" in err.getvalue()
    assert op.provider_calls == 0


@pytest.mark.django_db
def test_it_prepares_inside_a_run_and_returns_the_same_operation_on_resume(acme):
    run = Run.objects.create(
        conversation_id="conv_1",
        tenant=acme,
        workflow_name="pay",
        workflow_version=1,
        state_schema_version=1,
    )
    args = prepare_args(extra=("--run", run.id, "--command", "cmd_7"))
    first, again = _run(*args), _run(*args)
    assert first == again
    op = Operation.objects.get()
    assert (op.run_id, op.command_id) == (run.id, "cmd_7")


@pytest.mark.django_db
def test_it_refuses_a_command_without_its_run_however_often_it_is_retried(acme):
    """Only within its run is a command's intent found again: without --run, a runbook that
    retried `prepare --command cmd_pay_7` after a dropped session prepared a second payment
    intent (two approvals, two payments)."""
    for _ in range(2):
        with pytest.raises(CommandError) as refused:
            _run(*prepare_args(extra=("--command", "cmd_pay_7")))
        assert "without its run" in str(refused.value) and "\n" not in str(refused.value)
    assert not Operation.objects.exists()
    assert not AuditEvent.objects.filter(action="operation.prepare").exists()


@pytest.mark.django_db
def test_it_shows_an_operation_as_json(acme_unknown):
    data = json.loads(_run("show", acme_unknown.id, "--json"))
    op = acme_unknown
    assert data["operation_id"] == op.id
    assert data["status"] == "unknown" and data["error_code"] == "timeout"
    assert data["payload_hash"] == op.payload_hash
    assert data["idempotency_key"] == op.idempotency_key
    assert (data["tenant"], data["action"], data["external_id"]) == (
        "acme",
        "payments.create",
        "",
    )
    assert data["attempts"] == []
    text = _run("show", op.id)
    assert op.id in text and "unknown" in text and "Pay 12,500.00 KZT" in text


@pytest.mark.django_db
def test_it_lists_attempts_in_show(acme_payment):
    Attempt.objects.create(
        operation=acme_payment,
        number=1,
        kind="lookup",
        outcome="absent",
        http_status=200,
        external_id="",
    )
    data = json.loads(_run("show", acme_payment.id, "--json"))
    assert len(data["attempts"]) == 1
    attempt = data["attempts"][0]
    assert {k: attempt[k] for k in ("number", "kind", "outcome", "http_status")} == {
        "number": 1,
        "kind": "lookup",
        "outcome": "absent",
        "http_status": 200,
    }
    assert attempt["started_at"]


@pytest.mark.django_db
def test_it_executes_only_what_is_authorized(acme_payment):
    assert acme_payment.requires_approval  # payments always need a person's approval
    with pytest.raises(CommandError) as refused:
        _run("execute", acme_payment.id)
    acme_payment.refresh_from_db()
    assert str(refused.value) == (
        f"awaiting_authorization not_started: {acme_payment.id} has no approval to run; "
        "nothing was called (approve it in the approval queue first)"
    )
    assert acme_payment.provider_calls == 0 and acme_payment.status == "not_started"
    assert not acme_payment.attempts.exists()


@pytest.mark.django_db
def test_it_reconciles_and_reports_nothing_to_do_for_a_fresh_intent(acme_payment):
    assert _run("reconcile", acme_payment.id).strip() == "nothing_to_do not_started"
    assert not acme_payment.attempts.exists()


@pytest.mark.django_db
def test_it_lists_one_line_per_operation_of_a_status(acme, acme_payment):
    first = make_unknown(prepared_payment(acme, invoice_id="inv_u1"))
    second = make_unknown(prepared_payment(acme, invoice_id="inv_u2"))
    lines = _run("list", "--status", "unknown").splitlines()
    assert [line.split("\t")[0] for line in lines] == [second.id, first.id]
    assert _run("list", "--status", "unknown", "--limit", "1").splitlines()[0].startswith(second.id)
    # None of a status: no lines for a script, an answer for a person.
    out, err = io.StringIO(), io.StringIO()
    call_command("operations", "list", "--status", "disputed", stdout=out, stderr=err)
    assert out.getvalue() == "" and err.getvalue() == "no disputed operations\n"
    assert acme_payment.id not in _run("list", "--status", "unknown")


@pytest.mark.django_db
def test_it_lists_a_status_across_every_tenant(acme, globex):
    a = make_unknown(prepared_payment(acme, invoice_id="inv_a"))
    g = make_unknown(prepared_payment(globex, invoice_id="inv_g"))
    prepared_payment(acme, invoice_id="inv_ns")
    lines = _run("list", "--status", "unknown").splitlines()
    assert [line.split("\t")[0] for line in lines] == [g.id, a.id]
    # id, status, tenant, action, external id, summary: what runbooks read by column.
    assert [line.split("\t")[1:3] for line in lines] == [["unknown", "globex"],
                                                        ["unknown", "acme"]]
    assert all(len(line.split("\t")) == 6 for line in lines)


@pytest.mark.django_db
def test_it_says_on_stderr_when_more_operations_match_than_it_lists(acme):
    ops = [make_unknown(prepared_payment(acme, invoice_id=f"inv_{i}")) for i in range(51)]
    out, err = io.StringIO(), io.StringIO()
    call_command("operations", "list", "--status", "unknown", stdout=out, stderr=err)
    # The newest 50, as before, for a script; the oldest, unknown the longest, is not among
    # them, and a person is told so.
    listed = [line.split("\t")[0] for line in out.getvalue().splitlines()]
    assert listed == [op.id for op in reversed(ops[1:])]
    assert err.getvalue() == (
        "more than 50 unknown operations match; these are the newest 50 (--limit lists up "
        "to 10000; the console's journal pages through them all)\n"
    )
    # Exactly as many as asked for: nothing left out, nothing said.
    out, err = io.StringIO(), io.StringIO()
    call_command("operations", "list", "--status", "unknown", "--limit", "51",
                 stdout=out, stderr=err)
    assert len(out.getvalue().splitlines()) == 51 and err.getvalue() == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            prepare_args("{}", action="payments.refund"),
            "unknown action 'payments.refund'",
        ),
        (
            prepare_args("{nope"),
            "--payload is not valid JSON",
        ),
        (
            prepare_args({**PAYMENT, "beneficiary_id": "4111 1111 1111 1111"}),
            "looks like a full card number",
        ),
        (
            prepare_args(tenant="nowhere"),
            "no tenant 'nowhere'",
        ),
        (
            prepare_args(extra=("--run", "run_missing")),
            "no run 'run_missing'",
        ),
        (
            prepare_args(extra=("--command", "c" * 61)),
            "command id is longer than 60 characters",
        ),
        (("show", "op_missing"), "no operation 'op_missing'"),
        (("execute", "op_missing"), "no operation 'op_missing'"),
        (("reconcile", "op_missing"), "no operation 'op_missing'"),
    ],
)
def test_it_refuses_bad_input_with_a_clear_error(acme, args, message):
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _run(*args)
    assert not Operation.objects.exists()


CARD = "4111111111111111"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args",
    [
        ("show", CARD),
        ("execute", CARD),
        ("reconcile", CARD),
        prepare_args(tenant=CARD),
        prepare_args(extra=("--run", f"run_{CARD}")),
        prepare_args(extra=("--supersedes", "4111 1111 1111 1111")),
        ("show", "sk_live_abcdefghijklmnop"),
        # argparse's own refusals repeat an argument they do not take.
        ("show", "op_1", "4111\t1111\t1111\t1111"),
        ("list", "--status", CARD),
    ],
)
def test_it_never_repeats_a_card_number_or_a_secret_typed_where_an_id_goes(acme, args):
    # Refusals land in shells and CI logs: described, as intents name their keys.
    with pytest.raises(CommandError) as refused:
        _run(*args)
    message = str(refused.value)
    assert "looks like card data or a secret" in message
    assert "1111" not in message and "abcdefgh" not in message
    assert not Operation.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "named"),
    [
        # A forged second line in a script's log.
        ("note\nCommandError: nothing wrong here", "note\\nCommandError: nothing wrong here"),
        # An escape sequence that clears the operator's terminal.
        ("\x1b[2J\x1b[Hcleared", "\\x1b[2J\\x1b[Hcleared"),
    ],
)
def test_it_names_a_refused_key_in_one_line_without_control_characters(acme, key, named):
    with pytest.raises(CommandError) as refused:
        _run(*prepare_args({**PAYMENT, key: 1}))
    assert str(refused.value) == f"intent refused: payments.create: unexpected field(s): {named}"
    assert not Operation.objects.exists()


@pytest.mark.django_db
def test_it_escapes_every_refusal_whatever_a_layer_below_repeats(acme, monkeypatch):
    from operations.intents import IntentError
    from operations.management.commands import operations as command

    def refused(**kwargs):
        raise IntentError("said below\nCommandError: forged\x1b[2J\u2028")

    monkeypatch.setattr(command, "operation_prepare", refused)
    with pytest.raises(CommandError) as said:
        _run(*prepare_args())
    assert str(said.value) == "intent refused: said below\\nCommandError: forged\\x1b[2J\\u2028"
    # argparse repeats an argument it does not know as it was typed.
    with pytest.raises(CommandError) as said:
        _run("list", "--status", "unknown", "x\ny")
    assert str(said.value) == "Error: unrecognized arguments: x\\ny"


@pytest.mark.django_db(transaction=True)
def test_it_exits_non_zero_with_one_line_on_stderr(acme):
    from django.db import connection

    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "DEBUG": "1"}

    def manage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", "operations", *args],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = manage(*prepare_args())
    assert ok.returncode == 0, ok.stderr
    op_id = ok.stdout.strip()
    assert Operation.objects.filter(id=op_id).exists()
    shown = manage("show", op_id, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["operation_id"] == op_id

    for args, message in [
        (
            prepare_args("{}", action="nope.nope"),
            "unknown action",
        ),
        (
            prepare_args("[1,"),
            "not valid JSON",
        ),
        (
            prepare_args({**PAYMENT, "invoice_id": "card 4242424242424242"}),
            "full card number",
        ),
        (
            prepare_args("{}", tenant="ghost"),
            "no tenant",
        ),
        (("show", "op_ghost"), "no operation"),
        # Not approved: a script must not go on as if the payment had been attempted.
        (("execute", op_id), "nothing was called"),
        # A refused key is named escaped: it printed as two lines.
        (prepare_args({**PAYMENT, "a\nb": 1}), "unexpected field(s): a\\nb"),
        # What Python's JSON reader lets through, and what PostgreSQL or the canonical form
        # could not take: each a refusal, never a traceback.
        (prepare_args(json.dumps(PAYMENT).replace("1250000", "NaN")), "must be an integer"),
        (prepare_args({**PAYMENT, "amount_minor": 2**60}), "integers must be within"),
        (prepare_args({**PAYMENT, "invoice_id": "inv\u0000"}), "control character"),
        (prepare_args(json.dumps(PAYMENT).replace('"inv_', '"\\ud800inv_')),
         "unpaired surrogate"),
        (prepare_args({"target": "deal_1", "expected_version": 1, "patch": {"a\nb": 1}},
                      action="crm.update_deal"), "a key holds a control character"),
        (("show", ""), "no operation ''"),
        (("execute", "op_" + "Z" * 60), "no operation"),
    ]:
        result = manage(*args)
        assert result.returncode != 0, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert message in lines[0] and "Traceback" not in result.stderr
        assert result.stdout == "", (args, result.stdout)  # a script reads no id
    assert Operation.objects.count() == 1


@pytest.mark.django_db
def test_it_refuses_a_run_of_another_tenant(acme, globex):
    theirs = Run.objects.create(conversation_id="conv_g", tenant=globex, workflow_name="pay",
                                workflow_version=1, state_schema_version=1)
    with pytest.raises(CommandError, match=f"no run '{theirs.id}' in tenant acme"):
        _run(*prepare_args(extra=("--run", theirs.id)))
    assert not Operation.objects.exists()


@pytest.mark.django_db
def test_it_shows_every_field_of_an_operation_and_its_attempts_as_json(acme_payment):
    lookup = Attempt.objects.create(
        operation=acme_payment, number=1, kind="lookup", outcome="found", http_status=200,
        external_id="pi_9", provider_account="acct_1a2b", finished_at=timezone.now(),
        provider_request_id="req_4kT9", error_class="")
    data = json.loads(_run("show", acme_payment.id, "--json"))
    op = acme_payment
    assert data == {
        "operation_id": op.id, "tenant": "acme", "action": "payments.create",
        "status": "not_started", "external_id": "", "provider_request_id": "",
        "payload_hash": op.payload_hash, "idempotency_key": op.idempotency_key,
        "policy_version": op.policy_version, "run_id": None, "command_id": "",
        "supersedes": None, "resolved_manually": False, "error_code": "",
        "provider_calls": 0, "created_at": op.created_at.isoformat(),
        "attempts": [{"number": 1, "kind": "lookup", "outcome": "found", "http_status": 200,
                      "external_id": "pi_9", "provider_account": "acct_1a2b",
                      "provider_request_id": "req_4kT9", "error_class": "",
                      "started_at": lookup.started_at.isoformat(),
                      "finished_at": lookup.finished_at.isoformat(), "reach_until": None,
                      "held_for_review": False, "review_note": ""}],
    }


@pytest.mark.django_db
def test_it_shows_each_attempts_error_class_and_provider_request_id(acme_payment):
    # What tells a timeout from a 5xx or an idempotency_error, and what a provider's support
    # asks for: the attempt has both, and the operation's page shows both.
    CallAttemptFactory(
        operation=acme_payment, outcome="unknown", http_status=503,
        provider_request_id="req_8Hk2LmN0pQ", error_class="http_5xx",
        error_message="Service Unavailable",
    )
    attempt = json.loads(_run("show", acme_payment.id, "--json"))["attempts"][0]
    assert (attempt["error_class"], attempt["provider_request_id"]) == (
        "http_5xx", "req_8Hk2LmN0pQ")
    text = _run("show", acme_payment.id)
    assert "http=503 error=http_5xx request_id=req_8Hk2LmN0pQ" in text


@pytest.mark.django_db
@pytest.mark.parametrize("limit", ["0", "-1", "10001", str(10**20)])
def test_it_refuses_a_list_limit_out_of_its_bounds(acme_payment, limit):
    # 10**20 reached PostgreSQL as a LIMIT: "bigint out of range", a traceback.
    with pytest.raises(CommandError, match="--limit must be from 1 to 10000"):
        _run("list", "--status", "not_started", "--limit", limit)


@pytest.mark.django_db
def test_it_shows_a_call_answer_held_for_review(acme_payment):
    CallAttemptFactory(
        operation=acme_payment, outcome="succeeded", external_id="pi_1",
        needs_review=True, review_note="the provider reports succeeded (pi_1); stays disputed",
    )
    attempt = json.loads(_run("show", acme_payment.id, "--json"))["attempts"][0]
    assert (attempt["held_for_review"], attempt["review_note"]) == (
        True, "the provider reports succeeded (pi_1); stays disputed")
    text = _run("show", acme_payment.id)
    assert "held for review: the provider reports succeeded (pi_1); stays disputed" in text


@pytest.mark.django_db
def test_it_shows_until_when_a_call_may_reach_the_provider(acme_payment):
    call = CallAttemptFactory(operation=acme_payment, timeout=60)

    attempt = json.loads(_run("show", acme_payment.id, "--json"))["attempts"][0]

    assert attempt["finished_at"] is None
    assert attempt["reach_until"] == call.reach_until.isoformat()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "raw",
    [
        # Past what Python reads: json.loads raises ValueError, not JSONDecodeError.
        '{"invoice_id": "inv_1", "amount_minor": ' + "1" * 5000 + "}",
        # Thousands of levels: RecursionError.
        '{"params": ' + "[" * 5000 + "]" * 5000 + "}",
    ],
)
def test_it_refuses_a_payload_python_cannot_read_with_one_error(acme, raw):
    with pytest.raises(CommandError, match="--payload cannot be read"):
        _run(*prepare_args(raw))
    assert not Operation.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("raw", "action", "named"),
    [
        # An override appended to a built payload: json.loads kept the last, silently.
        ('{"invoice_id": "inv_9182", "beneficiary_id": "vendor_77", "amount_minor": 100, '
         '"amount_minor": 1250000, "currency": "KZT"}', "payments.create", "'amount_minor'"),
        # At any depth, and named as every refusal names what was typed.
        ('{"to": "anna@example.com", "template": "offer", '
         '"params": {"a\\nb": 1, "a\\nb": 2}}', "mail.send", "'a\\nb'"),
        ('{"to": "anna@example.com", "template": "offer", "params": '
         '{"4111 1111 1111 1111": 1, "4111 1111 1111 1111": 2}}', "mail.send",
         "<not repeated: looks like card data or a secret>"),
        # Groups parted by mixed marks: no card is written so, and an intent may hold them,
        # but a refusal repeating them holds back as it would a card.
        ('{"to": "anna@example.com", "template": "offer", "params": '
         '{"4111 1111-1111 1111": 1, "4111 1111-1111 1111": 2}}', "mail.send",
         "<not repeated: looks like card data or a secret>"),
    ],
)
def test_it_refuses_a_payload_that_names_a_key_twice(acme, raw, action, named):
    with pytest.raises(CommandError) as refused:
        _run(*prepare_args(raw, action=action))
    assert str(refused.value) == f"--payload names the key {named} more than once"
    assert not Operation.objects.exists() and not AuditEvent.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args",
    [
        # What Python makes of a byte that is not UTF-8 in argv (surrogateescape).
        ("show", "op_\udcff"),
        ("execute", "op_\udcff"),
        ("reconcile", "op_\udcff"),
        prepare_args(tenant="\udcff"),
        prepare_args(extra=("--run", "run_\udcff")),
    ],
)
def test_it_refuses_an_argument_that_is_not_utf8_with_one_error(acme, args):
    # It reached the database driver and raised there: a traceback.
    with pytest.raises(CommandError, match="is not UTF-8 text"):
        _run(*args)
    assert not Operation.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("list", "--status", "bogus"), "invalid choice: 'bogus'"),
        (("prepare", "--tenant", "acme"), "required: --action, --payload"),
        # The top parser's own mistakes, which Django's parser class answered at length.
        ((), "required: SUBCOMMAND"),
        (("list", "--status", "unknown", "--bogus"), "unrecognized arguments: --bogus"),
    ],
)
def test_it_says_a_usage_mistake_in_one_line(args, said):
    from django.db import connection

    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "DEBUG": "1"}
    result = subprocess.run([sys.executable, "manage.py", "operations", *args], cwd=BASE_DIR,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and said in result.stderr, result.stderr


@pytest.mark.django_db
def test_it_prints_one_line_per_operation_whatever_an_older_intent_holds(acme):
    """Intents refuse control characters now; one journaled before (or written past the
    engine) must still not forge a line of `list`, which runbooks read by column, nor send
    escape sequences to the operator's terminal."""
    from tests.helpers import updated_past_triggers

    op = prepared_payment(acme)
    forged = "op_01FORGED\tsucceeded\tacme\tpayments.create\tpi_fake\tok"
    updated_past_triggers(Operation.objects.filter(id=op.id),
                          payload={**PAYMENT, "invoice_id": f"inv_1\n{forged}\x1b[2J"})
    listed = _run("list", "--status", "not_started")
    assert [line.split("\t")[0] for line in listed.splitlines()] == [op.id]
    assert "\x1b" not in listed and "\\n" in listed and "\\x1b" in listed
    shown = _run("show", op.id)
    assert "\x1b" not in shown and "op_01FORGED" not in shown.split("\n", 2)[2]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("command_id", "said"),
    [
        ("4111 1111 1111 1111", "must be an id"),
        ("cmd_4111111111111111", "looks like card data or a secret"),
        ("sk_live_abcdefghijklmnop", "looks like card data or a secret"),
        ("cmd 1\nforged", "must be an id"),
    ],
)
def test_it_refuses_a_command_id_that_is_no_id(acme, command_id, said):
    # Journaled and shown as it is, on the operation's page and by `show`.
    with pytest.raises(CommandError, match=said):
        _run(*prepare_args(extra=("--command", command_id)))
    assert not Operation.objects.exists()


@pytest.mark.django_db
def test_it_names_the_shell_user_on_what_a_person_does_from_the_command_line(
    acme, settings
):
    op_id = _run(*prepare_args()).strip()
    prepared = AuditEvent.objects.get(action="operation.prepare", object_id=op_id)
    assert prepared.actor is None and prepared.actor_username.startswith("shell:")

    settings.PAYMENTS_API_BASE = "http://127.0.0.1:1/v1"  # the provider is down
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0
    op = make_unknown(prepared_payment(acme, invoice_id="inv_u"))
    assert _run("reconcile", op.id, "--reason", "bank asked").startswith("inconclusive unknown")
    # As the web's Reconcile now: who asked, why, and what the lookup left.
    asked = AuditEvent.objects.get(action="operation.reconcile", object_id=op.id)
    assert asked.actor_username == prepared.actor_username and asked.reason == "bank asked"
    assert asked.before == {"status": "unknown"} and asked.after["status"] == "unknown"
    assert _run("reconcile", op.id).startswith("inconclusive unknown")
    assert AuditEvent.objects.filter(
        action="operation.reconcile", object_id=op.id, reason="asked from the command line"
    ).count() == 1
    with pytest.raises(CommandError, match="card number"):
        _run("reconcile", op.id, "--reason", "card 4111 1111 1111 1111")
    assert not AuditEvent.objects.filter(reason__contains="4111").exists()
    # Outside a command (the beat's sweep, a worker) a row with no actor names nobody.
    from operations.services import audit_event_record

    assert audit_event_record(actor=None, action="test.event", tenant=acme).actor_username == ""


@pytest.mark.django_db
@pytest.mark.parametrize("reason", ["", "  "])
def test_it_refuses_a_blank_reason_to_reconcile_before_asking_the_provider(
    acme, monkeypatch, reason
):
    from tests.operations.failure_helpers import lookups_inconclusive

    op = make_unknown(prepared_payment(acme))
    lookups_inconclusive(monkeypatch)
    # Blank, the engine took it for the sweep's own lookup: no row of who asked.
    with pytest.raises(CommandError, match=r"^--reason must say why"):
        _run("reconcile", op.id, "--reason", reason)
    assert not Attempt.objects.filter(operation=op).exists()
    assert not AuditEvent.objects.filter(action="operation.reconcile").exists()
    _run("reconcile", op.id)  # left out, the default reason still names the shell's user
    assert Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).count() == 1
    assert AuditEvent.objects.filter(action="operation.reconcile", object_id=op.id).count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("reason", ["", "  "])
def test_it_refuses_a_blank_reason_to_execute_before_calling_the_provider(
    acme, settings, reason
):
    # The mail policy authorizes by itself; the provider is down, so a call's answer is lost.
    settings.MAIL_API_BASE = "http://127.0.0.1:9/sandbox/mail"
    op_id = _run(*prepare_args(
        {"to": "anna@example.com", "template": "receipt", "params": {}}, action="mail.send"
    )).strip()
    # Blank, the engine took it for the sweep's own run: a call with no row of who asked.
    with pytest.raises(CommandError, match=r"^--reason must say why"):
        _run("execute", op_id, "--reason", reason)
    assert Operation.objects.get(id=op_id).provider_calls == 0
    assert not AuditEvent.objects.filter(action="operation.execute").exists()


@pytest.mark.django_db
def test_it_exits_non_zero_when_execute_leaves_the_effect_undone(acme, approver):
    from datetime import timedelta

    from tests.operations.engine_helpers import authorized_payment

    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1)
    )
    # It printed "cancelled cancelled (…)" and exited 0: `execute OP && next step` went on.
    with pytest.raises(CommandError, match=r"cancelled cancelled .*: not done"):
        _run("execute", op.id)
    op.refresh_from_db()
    assert op.status == "cancelled" and op.provider_calls == 0


@pytest.mark.django_db
def test_it_masks_a_recipient_the_providers_refusal_repeats(acme, recipient_suppressed):
    op_id = _run(*prepare_args(
        {"to": "anna.petrova@example.com", "template": "receipt", "params": {}},
        action="mail.send",
    )).strip()
    printed = io.StringIO()
    # The operation's page shows the refusal masked; the command line printed it whole into
    # shells and CI logs.
    with pytest.raises(CommandError) as refused:
        call_command("operations", "execute", op_id, stdout=printed)
    said = str(refused.value) + printed.getvalue()
    assert Operation.objects.get(id=op_id).status == "failed"
    assert "anna.petrova@example.com" not in said
    assert "a***@example.com is on the suppression list" in said
    assert said.endswith(f"not done; 'operations show {op_id}' says why")


@pytest.mark.django_db(transaction=True)
def test_it_exits_zero_with_the_outcome_when_execute_carries_the_effect_out(
    acme, approver, providers
):
    from operations.sandbox.models import PaymentIntent
    from tests.operations.engine_helpers import authorized_payment

    op = authorized_payment(acme, approver)
    assert _run("execute", op.id, "--reason", "treasury runs it now").startswith(
        "called succeeded")
    op.refresh_from_db()
    assert op.provider_calls == 1 and op.external_id == PaymentIntent.objects.get().id
    assert _run("execute", op.id).startswith("already_succeeded succeeded")
    assert PaymentIntent.objects.count() == 1
    # Who ran it by hand, why, and what it moved: as prepare and reconcile are.
    first, again = AuditEvent.objects.filter(
        action="operation.execute", object_id=op.id).order_by("id")
    assert first.actor is None and first.actor_username.startswith("shell:")
    assert first.reason == "treasury runs it now"
    # Written with the claim, before the call goes out: on the trail however the run ends.
    assert first.before == {"status": "not_started"}
    assert first.after == {"status": "in_progress", "call": 1}
    assert again.reason == "asked from the command line"
    assert again.after["outcome"] == "already_succeeded"


@pytest.mark.django_db
def test_it_audits_a_run_asked_for_by_a_person_that_is_interrupted_mid_call(
    acme, approver, monkeypatch
):
    from operations import engine
    from tests.operations.engine_helpers import authorized_payment

    op = authorized_payment(acme, approver)

    def interrupted(snapshot):
        raise KeyboardInterrupt  # Ctrl-C while the request is out

    monkeypatch.setattr(engine.core.adapter(op.action), "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.operation_execute(operation_id=op.id, reason="treasury runs it now")
    op.refresh_from_db()
    assert (op.status, op.provider_calls) == ("in_progress", 1)
    asked = AuditEvent.objects.get(action="operation.execute", object_id=op.id)
    assert asked.reason == "treasury runs it now" and asked.after["status"] == "in_progress"


@pytest.mark.django_db
def test_it_says_when_a_commands_intent_exists_already_and_supersedes_on_request(acme):
    run = Run.objects.create(conversation_id="conv_cli", tenant=acme, workflow_name="pay",
                             workflow_version=1, state_schema_version=1)
    args = prepare_args(extra=("--run", run.id, "--command", "cmd_pay"))
    first = _run(*args).strip()
    Operation.objects.filter(id=first).update(status="cancelled")
    out, err = io.StringIO(), io.StringIO()
    call_command("operations", *args, stdout=out, stderr=err)
    # Its id again, never a second intent; and it says that this one is dead.
    assert out.getvalue().strip() == first and Operation.objects.count() == 1
    assert err.getvalue().strip() == (
        f"{first} is already this command's intent, cancelled; nothing new was prepared "
        "(a changed intent replaces it: --supersedes)"
    )
    # What that error told the operator to do, the command now can.
    changed = _run(*prepare_args({**PAYMENT, "amount_minor": 1_300_000},
                                 extra=("--run", run.id, "--command", "cmd_pay",
                                        "--supersedes", first))).strip()
    assert Operation.objects.get(id=changed).supersedes_id == first
    with pytest.raises(CommandError, match="no operation 'op_ghost' in tenant acme"):
        _run(*prepare_args(extra=("--supersedes", "op_ghost")))


@pytest.mark.django_db(transaction=True)
def test_it_ends_quietly_when_the_reader_of_its_output_stops(acme):
    from django.db import connection

    for n in range(3):
        prepared_payment(acme, invoice_id=f"inv_{n}")
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "DEBUG": "1"}
    listing = subprocess.Popen(
        [sys.executable, "manage.py", "operations", "list", "--status", "not_started",
         "--limit", "1000"],
        cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    # Closed before it writes, as `| head -1` is after its line: every write then fails, not
    # only those past what the pipe's buffer took.
    listing.stdout.close()
    stderr = listing.stderr.read().decode()
    assert listing.wait(timeout=60) == 141
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.django_db(transaction=True)
def test_it_never_prints_the_api_key_from_operations_reconcile(
    acme, approver, maintenance_page, settings
):
    from operations.engine import operation_execute
    from tests.operations.engine_helpers import authorized_payment

    key = "sk_live_51RevIewSecretKeyValue0123456789"
    settings.PAYMENTS_API_KEY = key + "\n"  # as read from a secret file: no request is sent
    op = authorized_payment(acme, approver)
    operation_execute(operation_id=op.id)

    printed = _run("reconcile", op.id, "--reason", "runbook step 3")
    # README: the command line never repeats what looks like card data or a secret.
    assert key not in printed, printed
