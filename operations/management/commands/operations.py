"""`manage.py operations …`: thin operator wrappers over the engine, for scripts and shells."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from operations.engine import EngineError, operation_execute, operation_prepare, operation_reconcile
from operations.intents import IntentError, intent_summary, mask_person_text, secret_may_be_in
from operations.management.arguments import text_arguments_check
from operations.models import Operation, OperationStatus, Run, Tenant
from operations.services import audit_actor_from_shell, shell_person

# What `list` takes at once: past this, page with a narrower status or read the journal.
LIST_LIMIT_MAX = 10_000
# Where execute leaves the effect done, or taken by the provider (its final answer follows).
EFFECT_DONE = {OperationStatus.SUCCEEDED, OperationStatus.ACCEPTED}
# Control characters in what is printed: an operation journaled before intents refused them
# could forge a line of `list` or drive the operator's terminal. The line and paragraph
# separators too: Python's splitlines, and log viewers with it, break lines there.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _printable(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def _said(report: Any) -> str:
    """An execute or reconcile report as one line: outcome, status, and why. The why may be
    the provider's refusal, which can repeat a recipient's address or number: masked, as the
    operation's page shows it."""
    detail = f" ({_printable(mask_person_text(report.detail))})" if report.detail else ""
    return f"{report.outcome} {report.status}{detail}"


def _typed(value: str) -> str:
    """What was typed where an id or a slug goes, as a refusal may repeat it. Refusals land
    in shells and CI logs, so a card number or a secret pasted there is described, never
    repeated, as intents name their keys."""
    if secret_may_be_in(value):
        return "<not repeated: looks like card data or a secret>"
    return repr(value)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of --payload, refused if it names a key twice. The intent is hashed as
    RFC 8785 canonical JSON, made for I-JSON, whose member names are unique; json.loads
    keeps the last of two silently, so a payload built by appending an override would be
    prepared, hashed and approved as other than the intent its text reads as first."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise CommandError(f"--payload names the key {_typed(key)} more than once")
        members[key] = value
    return members


def _reason(options: dict[str, Any]) -> str:
    """The engine takes a blank reason for no person asking (the sweep's own run): a call or a
    lookup asked with `--reason ''` left no row of who asked on the audit trail."""
    if not options["reason"].strip():
        raise CommandError(
            "--reason must say why: it goes on the audit trail with the shell's user "
            "(leave it out for the default)"
        )
    return options["reason"]


def _operation(operation_id: str) -> Operation:
    op = Operation.objects.select_related("tenant").filter(id=operation_id).first()
    if op is None:
        raise CommandError(f"no operation {_typed(operation_id)}")
    return op


def _as_dict(op: Operation) -> dict[str, Any]:
    return {
        "operation_id": op.id,
        "tenant": op.tenant.slug,
        "action": op.action,
        "status": op.status,
        "external_id": op.external_id,
        "provider_request_id": op.provider_request_id,
        "payload_hash": op.payload_hash,
        "idempotency_key": op.idempotency_key,
        "policy_version": op.policy_version,
        "run_id": op.run_id,
        "command_id": op.command_id,
        "supersedes": op.supersedes_id,
        "resolved_manually": op.resolved_manually,
        "error_code": op.error_code,
        "provider_calls": op.provider_calls,
        "created_at": op.created_at.isoformat(),
        "attempts": [
            {
                "number": a.number,
                "kind": a.kind,
                "outcome": a.outcome,
                "http_status": a.http_status,
                # What tells a timeout from a 5xx or a refusal, and what the provider's
                # support asks for. The class may be the provider's own code: masked, as the
                # operation's timeline shows it.
                "error_class": mask_person_text(a.error_class),
                "provider_request_id": a.provider_request_id,
                "external_id": a.external_id,
                "provider_account": a.provider_account,
                "started_at": a.started_at.isoformat(),
                "finished_at": a.finished_at.isoformat() if a.finished_at else None,
                # A call's latest moment to reach the provider (None for a lookup).
                "reach_until": a.reach_until.isoformat() if a.reach_until else None,
                # A late answer that contradicts the journal, until a person decides.
                "held_for_review": a.needs_review and a.reviewed_at is None,
                "review_note": a.review_note,
            }
            for a in op.attempts.order_by("number")
        ],
    }


class _OneLineErrors(CommandParser):
    """A usage mistake in one line, as every other refusal of this command is: argparse's
    usage block before it was three to five lines for a script's log to carry."""

    def error(self, message: str) -> None:
        # argparse repeats what was typed ("unrecognized arguments: …") as it is: looked at
        # before it is escaped, which would part the groups of a card number.
        if secret_may_be_in(message):
            message = "an argument looks like card data or a secret (not repeated)"
        message = _printable(message)
        if self.called_from_command_line:
            self.exit(2, f"{self.prog}: error: {message} (--help says more)\n")
        super().error(message)


class Command(BaseCommand):
    help = "Prepare, show, execute, reconcile and list operations (wrappers over the engine)."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # Django builds the top parser itself; its mistakes (no subcommand, an option it
        # does not know) are one line too.
        parser.__class__ = _OneLineErrors
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(
            dest="subcommand", required=True, metavar="SUBCOMMAND", parser_class=_OneLineErrors
        )

        prepare = sub.add_parser("prepare", help="record a new intent; prints its operation id")
        prepare.add_argument("--tenant", required=True, help="tenant slug")
        prepare.add_argument("--action", required=True, help="e.g. payments.create")
        prepare.add_argument("--payload", required=True, help="the intent as a JSON object")
        prepare.add_argument("--run", default="", help="run id the intent belongs to")
        prepare.add_argument(
            "--command", default="", dest="command_id", help="the run's command id (with --run)"
        )
        prepare.add_argument(
            "--supersedes", default="", help="the operation this changed intent replaces"
        )

        show = sub.add_parser("show", help="one operation and its attempts")
        show.add_argument("operation_id")
        show.add_argument("--json", action="store_true", help="print JSON")

        execute = sub.add_parser("execute", help="run the approved intent at most once")
        execute.add_argument("operation_id")
        execute.add_argument(
            "--reason", default="asked from the command line",
            help="why; on the audit trail with the shell's user",
        )

        reconcile = sub.add_parser("reconcile", help="ask the provider what really happened")
        reconcile.add_argument("operation_id")
        reconcile.add_argument(
            "--reason", default="asked from the command line",
            help="why; on the audit trail with the shell's user",
        )

        listing = sub.add_parser("list", help="operations in one status, newest first")
        listing.add_argument("--status", required=True, choices=OperationStatus.values)
        listing.add_argument("--limit", type=int, default=50)

    def handle(self, *args: Any, **options: Any) -> None:
        handler = getattr(self, f"_{options['subcommand']}")
        try:
            text_arguments_check(options)
            with audit_actor_from_shell():
                handler(options)
            self.stdout.flush()  # here, not at exit, where a closed pipe cannot be caught
        except CommandError as exc:
            # A refusal may repeat what was typed or what a layer below said of it: escaped
            # here, once for all, so none can span lines in a script's log or drive a terminal.
            raise CommandError(_printable(str(exc)), returncode=exc.returncode) from exc
        except BrokenPipeError:
            # `operations list … | head`: the reader has what it wanted. Python would print
            # a traceback, and another at exit flushing stdout into the closed pipe.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(141) from None  # as a shell reports a process ended by SIGPIPE

    def _prepare(self, options: dict[str, Any]) -> None:
        tenant = Tenant.objects.filter(slug=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant {_typed(options['tenant'])}")
        try:
            payload = json.loads(options["payload"], object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--payload is not valid JSON: {exc}") from exc
        except (ValueError, RecursionError) as exc:
            # Past what Python reads: an integer of thousands of digits, thousands of levels.
            raise CommandError(f"--payload cannot be read: {str(exc)[:120]}") from exc
        run = None
        if options["run"]:
            run = Run.objects.filter(id=options["run"], tenant=tenant).first()
            if run is None:
                raise CommandError(f"no run {_typed(options['run'])} in tenant {tenant.slug}")
        supersedes = None
        if options["supersedes"]:
            supersedes = Operation.objects.filter(
                id=options["supersedes"], tenant=tenant
            ).first()
            if supersedes is None:
                raise CommandError(
                    f"no operation {_typed(options['supersedes'])} in tenant {tenant.slug}"
                )
        started = timezone.now()
        try:
            op = operation_prepare(
                tenant=tenant,
                action=options["action"],
                payload=payload,
                run=run,
                command_id=options["command_id"],
                supersedes=supersedes,
                author=shell_person(),
            )
        except IntentError as exc:
            raise CommandError(f"intent refused: {exc}") from exc
        self.stdout.write(op.id)
        if op.created_at < started:
            # The run's command already has this very intent: its id again, never a second
            # one. Said on stderr, with what became of it (a cancelled one stays cancelled).
            self.stderr.write(
                f"{op.id} is already this command's intent, {op.status}; nothing new was "
                "prepared" + ("" if op.status != OperationStatus.CANCELLED else
                              " (a changed intent replaces it: --supersedes)")
            )
            return
        if op.authorized_hash:
            # Said on stderr: stdout stays the bare id for scripts.
            self.stderr.write(
                "authorized by policy: the sweep runs it within "
                f"{settings.EXECUTE_RECHECK_SECONDS}s; 'operations execute {op.id}' runs it now"
            )

    def _show(self, options: dict[str, Any]) -> None:
        op = _operation(options["operation_id"])
        data = _as_dict(op)
        if options["json"]:
            self.stdout.write(json.dumps(data, indent=2))
            return
        self.stdout.write(f"{op.id}  {op.status}  {op.tenant.slug}  {op.action}")
        self.stdout.write(f"  {_printable(intent_summary(action=op.action, payload=op.payload))}")
        for key in ("payload_hash", "idempotency_key", "external_id", "error_code"):
            if data[key]:
                self.stdout.write(f"  {key}: {_printable(data[key])}")
        for a in data["attempts"]:
            self.stdout.write(
                f"  attempt {a['number']} {a['kind']} {a['outcome']}"
                f" http={a['http_status'] or '-'}"
                f" error={_printable(a['error_class'] or '-')}"
                f" request_id={_printable(a['provider_request_id'] or '-')}"
                f" external_id={_printable(a['external_id'] or '-')} at {a['started_at']}"
                + (f"\n    held for review: {_printable(a['review_note'])}"
                   if a["held_for_review"] else "")
            )

    def _execute(self, options: dict[str, Any]) -> None:
        reason = _reason(options)
        op = _operation(options["operation_id"])
        try:
            report = operation_execute(operation_id=op.id, reason=reason)
        except EngineError as exc:
            raise CommandError(f"execute refused: {exc}") from exc
        if report.outcome == "awaiting_authorization":
            # Nothing ran: a runbook's `operations execute … && next step` must not go on as
            # if the effect had been attempted.
            raise CommandError(
                f"awaiting_authorization {report.status}: {op.id} has no approval to run; "
                "nothing was called (approve it in the approval queue first)"
            )
        said = _said(report)
        if report.status not in EFFECT_DONE:
            # Cancelled (the approval ran out), unknown, failed, held by another worker: a
            # runbook's `&& next step` must not go on as if the effect had happened.
            raise CommandError(f"{said}: not done; 'operations show {op.id}' says why")
        self.stdout.write(said)

    def _reconcile(self, options: dict[str, Any]) -> None:
        reason = _reason(options)
        op = _operation(options["operation_id"])
        try:
            report = operation_reconcile(operation_id=op.id, reason=reason)
        except EngineError as exc:
            raise CommandError(f"reconcile refused: {exc}") from exc
        self.stdout.write(_said(report))
        if report.may_call_again:
            # A thin wrapper runs nothing it was not asked to: it says what comes next.
            self.stdout.write(
                f"may call again with the same key: the sweep queues it within "
                f"{settings.EXECUTE_RECHECK_SECONDS}s; 'operations execute {op.id}' runs it now"
            )

    def _list(self, options: dict[str, Any]) -> None:
        limit = options["limit"]
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise CommandError(f"--limit must be from 1 to {LIST_LIMIT_MAX}")
        # One past the limit, to know whether more match: cut off in silence, a runbook
        # reading the newest never reached the oldest unknowns, those waiting the longest.
        found = list(
            Operation.objects.filter(status=options["status"])
            .select_related("tenant")
            .order_by("-id")[: limit + 1]
        )
        ops = found[:limit]
        for op in ops:
            summary = intent_summary(action=op.action, payload=op.payload)
            self.stdout.write(
                f"{op.id}\t{op.status}\t{op.tenant.slug}\t{op.action}\t"
                f"{_printable(op.external_id or '-')}\t{_printable(summary)}"
            )
        if not ops:
            # On stderr: a script reading stdout still gets no lines, a person gets an answer.
            self.stderr.write(f"no {options['status']} operations")
        elif len(found) > limit:
            # On stderr too: stdout stays one line per operation for scripts.
            self.stderr.write(
                f"more than {limit} {options['status']} operations match; these are the "
                f"newest {limit} (--limit lists up to {LIST_LIMIT_MAX}; the console's journal "
                "pages through them all)"
            )
