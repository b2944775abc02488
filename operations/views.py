from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from operations import transitions
from operations.engine import (
    EngineError,
    dispute_applies,
    lease_expired,
    operation_dispute,
    operation_reconcile,
    operation_resolve,
    reconcile_applies,
)
from operations.forms import (
    DecisionForm,
    OperationFilterForm,
    ReasonForm,
    ResolveForm,
    form_problem,
)
from operations.htmx import page_render, page_unmasking, unmasked_never_cached
from operations.intents import deal_found_rows, intent_rows, intent_summary, words_given_back
from operations.models import Operation, OperationStatus
from operations.providers import adapter_for
from operations.selectors import (
    answers_for_review_count,
    answers_for_review_for_user,
    answers_held_for_review,
    checks_overdue_before,
    lookups_failing_limit_from,
    operation_for_user,
    operation_lineage,
    operation_superseded_by,
    operation_timeline,
    operations_disputed_count,
    operations_disputed_queue,
    operations_journal_page,
    operations_lookup_failing_count,
    operations_lookup_failing_queue,
    operations_not_run_count,
    operations_not_run_queue,
    operations_stuck_count,
    operations_stuck_queue,
    operations_unknown_count,
    operations_unknown_queue,
    related_pages_for_user,
    run_parent_in_tenant,
    tenant_perm_held,
    tenants_for_user,
    webhooks_for_review_count,
    webhooks_for_review_for_user,
    webhooks_held_for_review,
)
from operations.tasks import execute_on_commit

S = OperationStatus
PAGE_SIZE = 50
UNKNOWN_QUEUE_SIZE = 100
DETAIL = "operations/detail.html"


@require_GET
def operation_list(request: HttpRequest) -> HttpResponse:
    slugs = list(tenants_for_user(request.user).values_list("slug", flat=True))
    form = OperationFilterForm(request.GET, tenant_slugs=slugs)
    if form.is_valid():
        page, next_cursor = operations_journal_page(
            request.user, filters=form.filters(), before=form.cleaned_data.get("before"),
            size=PAGE_SIZE,
        )
    else:
        # A filter the user may not use (another tenant's slug) shows nothing, not everything.
        page, next_cursor = [], None
    query = request.GET.copy()
    query.pop("before", None)
    context = {
        "form": form,
        "rows": [(op, intent_summary(action=op.action, payload=op.payload)) for op in page],
        "next_cursor": next_cursor,
        "query": query.urlencode(),
        "now": timezone.now(),
    }
    return page_render(request, "operations/list.html", context, partial="rows")


def _summarized(ops: list[Operation]) -> list[tuple[Operation, str]]:
    """Queue rows: each operation with its masked one-line intent."""
    return [(op, intent_summary(action=op.action, payload=op.payload)) for op in ops]


@require_GET
def operation_unknown(request: HttpRequest) -> HttpResponse:
    user = request.user

    def in_all(shown: list, count: Callable[[Any], int]) -> int | None:
        # Only a full page can have more behind it; then say how many wait in all.
        return count(user) if len(shown) == UNKNOWN_QUEUE_SIZE else None

    rows = _summarized(operations_unknown_queue(user, limit=UNKNOWN_QUEUE_SIZE))
    held = webhooks_for_review_for_user(user, limit=UNKNOWN_QUEUE_SIZE)
    held_answers = answers_for_review_for_user(user, limit=UNKNOWN_QUEUE_SIZE)
    disputed = _summarized(operations_disputed_queue(user, limit=UNKNOWN_QUEUE_SIZE))
    stuck = _summarized(operations_stuck_queue(user, limit=UNKNOWN_QUEUE_SIZE))
    not_run = _summarized(operations_not_run_queue(user, limit=UNKNOWN_QUEUE_SIZE))
    lookup_failing = _summarized(
        operations_lookup_failing_queue(user, limit=UNKNOWN_QUEUE_SIZE)
    )
    # An auditor reads the same queue; it must not tell them to do what they may not. Row by
    # row: one person may operate one tenant's effects and only audit another's.
    operating = set(tenants_for_user(user, "operate_operations").values_list("id", flat=True))
    listed = {op.tenant_id for op, _ in (*rows, *disputed, *stuck, *not_run, *lookup_failing)} | {
        row.operation.tenant_id for row in (*held, *held_answers)
    }
    return render(request, "operations/unknown.html", {
        "rows": rows, "total": in_all(rows, operations_unknown_count),
        "held": held, "held_total": in_all(held, webhooks_for_review_count),
        "held_answers": held_answers,
        "held_answers_total": in_all(held_answers, answers_for_review_count),
        "disputed": disputed, "disputed_total": in_all(disputed, operations_disputed_count),
        "stuck": stuck, "stuck_total": in_all(stuck, operations_stuck_count),
        "not_run": not_run, "not_run_total": in_all(not_run, operations_not_run_count),
        "lookup_failing": lookup_failing,
        "lookup_failing_total": in_all(lookup_failing, operations_lookup_failing_count),
        # As a moment, so the page says the limit in words ("1 hour") with timesince.
        "lookup_failing_limit_from": lookups_failing_limit_from(),
        "operating": operating,
        "may_operate": bool(operating & listed),
        "may_resolve_lookup_failing": any(op.tenant_id in operating for op, _ in lookup_failing),
        "may_reconcile_stuck": any(op.tenant_id in operating for op, _ in stuck),
        "checks_overdue_before": checks_overdue_before(),
        # Nothing waits "for a person" is no claim to make to someone who sees no tenant.
        "sees_a_tenant": tenants_for_user(request.user).exists(),
    })


def _panel_context(
    request: HttpRequest,
    op: Operation,
    *,
    forms: dict[str, Any] | None = None,
    drafts: dict[str, dict[str, Any]] | None = None,
    notice: str = "",
    notice_level: str = "",
    done: str = "",
) -> dict[str, Any]:
    """`done`: the prefix of the action that just went through; its fields come back empty
    (the others' drafts stay, hx-preserve'd). `drafts`: what was typed into a refused action,
    shown again in fresh forms (the status and held reports they answer are read anew)."""
    can_operate = tenant_perm_held(request.user, "operate_operations", op.tenant)
    # The buttons follow the engine: reconcile where a reconcile would ask the provider (an
    # open outcome, or a stuck lease); resolve where the table allows it; dispute there too,
    # and on a finished effect someone contests (a payment the beneficiary says never came).
    can_reconcile = can_operate and reconcile_applies(op)
    forms = forms or {}
    drafts = drafts or {}
    held = list(webhooks_held_for_review(operation=op).order_by("received_at"))
    held_answers = list(answers_held_for_review(operation=op).order_by("number"))
    shown = {
        "held_shown": " ".join(str(event.id) for event in held),
        "held_answers_shown": " ".join(str(attempt.id) for attempt in held_answers),
    }
    action_forms = {
        "reconcile": forms.get("reconcile")
        or ReasonForm(prefix="reconcile", initial=drafts.get("reconcile")),
        "resolve": forms.get("resolve")
        or ResolveForm(prefix="resolve", initial={
            **drafts.get("resolve", {}), "seen": op.status_changed_at, **shown,
        }),
        "dispute": forms.get("dispute")
        or DecisionForm(prefix="dispute", initial={
            **drafts.get("dispute", {}), "seen": op.status_changed_at, **shown,
        }),
    }
    if done in action_forms:
        # Kept in place, a reason already written to the audit trail would go with the next
        # press of the same button.
        for field in action_forms[done].fields.values():
            field.widget.attrs.pop("hx-preserve", None)
    return {
        "op": op,
        "lease_expired": lease_expired(op),
        # Bounded unless a person asks for all of it (`?timeline=whole`).
        "timeline": operation_timeline(op, whole=request.GET.get("timeline") == "whole"),
        "held_for_review": held,
        "held_answers": held_answers,
        "can_reconcile": can_reconcile,
        "can_resolve": can_operate and transitions.allowed(op.status, S.SUCCEEDED, manual=True),
        "can_dispute": can_operate and dispute_applies(op),
        **{f"{prefix}_form": form for prefix, form in action_forms.items()},
        "notice": notice,
        "notice_level": notice_level,
        "seen": _seen(op),
        # The panel re-rendered after an action is the masked page's (see _respond).
        "unmasked": False,
    }


def _seen(op: Operation) -> str:
    """What the page's status watch compares: the status, and when it last changed."""
    return f"{op.status}@{op.status_changed_at.timestamp():.6f}"


@require_GET
# A fragment or the page from one URL: a cache must never hand out one for the other.
@vary_on_headers("HX-Request")
def operation_detail(request: HttpRequest, operation_id: str) -> HttpResponse:
    op = operation_for_user(request.user, operation_id)
    seen = request.GET.get("seen", "")
    if request.htmx and seen:
        # The page's own poll: only whether the operation moved on since it was rendered.
        return render(request, f"{DETAIL}#status_watch", {
            "op": op, "seen": seen, "moved_on": seen != _seen(op),
        })
    unmasked, may_unmask = page_unmasking(
        request, op.tenant, action="operation.view_unmasked", object_type="operation",
        object_id=op.id,
    )
    context = _page_context(request, op, unmasked=unmasked)
    context["may_unmask"] = may_unmask
    return unmasked_never_cached(render(request, DETAIL, context), unmasked=unmasked)


def _page_context(request: HttpRequest, op: Operation, *, unmasked: bool, **panel: Any) -> dict:
    lineage = operation_lineage(op)
    related_pages = related_pages_for_user(request.user, op)
    return {
        **_panel_context(request, op, **panel),
        "intent": intent_rows(action=op.action, payload=op.payload, unmasked=unmasked),
        # A version conflict is for a person to decide on: the deal as the CRM then held it.
        "deal_found": deal_found_rows(
            action=op.action, payload=op.payload, result=op.result, unmasked=unmasked
        ),
        "unmasked": unmasked,
        "lineage": lineage,
        "run_parent_id": run_parent_in_tenant(lineage.run) if lineage.run else None,
        "superseded_by": operation_superseded_by(op),
        "contract_facts": adapter_for(op.action).contract.facts(),
        "related_pages": related_pages,
        # Newest first: the request that still counts names where authorization stands.
        "authorization_note": next(
            (page.authorization for page in related_pages if page.authorization), ""
        ),
    }


def _respond(
    request: HttpRequest,
    op: Operation,
    *,
    ok: bool,
    message: str,
    level: str = "",
    form_key: str = "",
    form: Any = None,
    draft: dict[str, Any] | None = None,
    refused_status: int = 409,
) -> HttpResponse:
    """htmx: re-render the status/actions/timeline panel in place; otherwise PRG. `level`:
    "info" for an action that went through but settled nothing. `draft`: what was typed into
    an action the engine refused, kept on the page to correct or send again."""
    op.refresh_from_db()
    level = level or ("success" if ok else "error")
    if form is not None and not ok:
        _words_given_back(form)
    if draft is not None:
        draft = {name: words_given_back(value) if isinstance(value, str) else value
                 for name, value in draft.items()}
    if form is not None and not ok and "seen" in form.fields:
        message += _seeing_the_status_now(form, op)
    if request.htmx:
        context = _panel_context(
            request,
            op,
            forms={form_key: form} if form is not None and not ok else None,
            notice=message,
            notice_level=level,
            done=form_key if ok else "",
        )
        return render(request, f"{DETAIL}#panel", context)
    if form is not None and not ok and form.errors:
        # A form error keeps what was typed: the whole page again, not a redirect.
        # Masked: this page is not the audited unmasked view.
        context = _page_context(
            request, op, unmasked=False, forms={form_key: form}, notice=message,
            notice_level="error",
        )
        return render(request, DETAIL, context, status=400)
    if draft is not None and not ok:
        # Refused by the engine (the status moved on, a call may still land): without
        # JavaScript too, what was typed stays for the person to send again later.
        context = _page_context(
            request, op, unmasked=False, drafts={form_key: draft}, notice=message,
            notice_level="error",
        )
        return render(request, DETAIL, context, status=refused_status)
    {"success": messages.success, "info": messages.info}.get(level, messages.error)(
        request, message
    )
    return redirect(reverse("operations:detail", args=[op.id]))


def _words_given_back(form: Any) -> None:
    """A form sent back to correct shows what was typed, but never a card number or a
    secret it was refused for (`words_given_back`): only what is rendered changes."""
    data = form.data.copy()
    for name, field in form.fields.items():
        key = form.add_prefix(name)
        if field.widget.is_hidden or not isinstance(data.get(key), str):
            continue
        data[key] = words_given_back(data[key])
    form.data = data


def _seeing_the_status_now(form: Any, op: Operation) -> str:
    """A decision's form sent back after an error goes beside the status the page now shows
    (`op`, as rendered): its next press decides on that, not on the status it was first sent
    from, which the engine would refuse once as out of date. When the status has moved on
    since, the person is told so here, before they press again: what follows is never a
    decision taken on the old status without their knowing. Returns those words, or ""."""
    sent = form.cleaned_data.get("seen")
    data = form.data.copy()
    data[form.add_prefix("seen")] = op.status_changed_at.isoformat()
    form.data = data  # only what is rendered: its errors were found on what was sent
    if sent == op.status_changed_at:
        return ""
    return (
        f" {op.id} is now {op.get_status_display().lower()} (since "
        f"{op.status_changed_at:%H:%M:%S} UTC), not what your page showed before; check it "
        "before you send this again."
    )


def _operator_action(
    request: HttpRequest,
    operation_id: str,
    *,
    form_class: type[ReasonForm],
    prefix: str,
    verb: str,
    incomplete: str,
    act: Callable[[Operation, dict[str, Any]], str | tuple[str, str]],
) -> HttpResponse:
    """One operator button: access (404/403) first, then the form, then the engine; engine
    refusals become a message on the page, never a 500."""
    op = operation_for_user(request.user, operation_id, "operate_operations")
    form = form_class(request.POST, prefix=prefix)
    if not form.is_valid():
        return _respond(request, op, ok=False, message=form_problem(form, incomplete=incomplete),
                        form_key=prefix, form=form)
    try:
        done = act(op, form.cleaned_data)
    except (EngineError, PermissionDenied) as exc:
        field = getattr(exc, "field", "")
        if field in form.fields:
            # About what was typed (a reference the provider did not confirm): shown at the
            # field, with the draft kept to correct, as a form error is.
            form.add_error(field, str(exc))
            return _respond(request, op, ok=False, message=f"{verb} refused: {exc}",
                            form_key=prefix, form=form)
        typed = {name: value for name, value in form.cleaned_data.items()
                 if not form.fields[name].widget.is_hidden}
        return _respond(request, op, ok=False, message=f"{verb} refused: {exc}",
                        form_key=prefix, draft=typed,
                        refused_status=403 if isinstance(exc, PermissionDenied) else 409)
    message, level = done if isinstance(done, tuple) else (done, "success")
    return _respond(request, op, ok=True, message=message, level=level, form_key=prefix)


@require_POST
def operation_reconcile_view(request: HttpRequest, operation_id: str) -> HttpResponse:
    def act(op: Operation, data: dict[str, Any]) -> tuple[str, str]:
        report = operation_reconcile(operation_id=op.id, actor=request.user, reason=data["reason"])
        detail = f" ({report.detail})" if report.detail else ""
        if report.may_call_again:
            # Proven absent and authorized: as the sweep's reconcile does, hand it back to
            # a worker, or it would wait in not_started with nobody to run it.
            execute_on_commit(op.id)
            detail += "; queued to run again with the same key"
        # Green only when the lookup settled something; "still unknown" is news, not success.
        level = "success" if report.outcome in ("found", "absent") else "info"
        outcome = report.outcome.replace("_", " ")
        return f"Reconcile: {outcome}; status {report.status}{detail}.", level

    return _operator_action(
        request, operation_id, form_class=ReasonForm, prefix="reconcile", verb="Reconcile",
        incomplete="Give a reason to reconcile.", act=act,
    )


@require_POST
def operation_resolve_view(request: HttpRequest, operation_id: str) -> HttpResponse:
    def act(op: Operation, data: dict[str, Any]) -> str:
        op = operation_resolve(
            operation_id=op.id,
            actor=request.user,
            outcome=data["outcome"],
            evidence_text=data["evidence"],
            reason=data["reason"],
            provider_reference=data["provider_reference"].strip(),
            seen_status_changed_at=data.get("seen"),
            held_shown=data["held_shown"],
            held_answers_shown=data["held_answers_shown"],
        )
        return f"Resolved as {op.status}."

    return _operator_action(
        request, operation_id, form_class=ResolveForm, prefix="resolve", verb="Resolve",
        incomplete="The resolution is incomplete.", act=act,
    )


@require_POST
def operation_dispute_view(request: HttpRequest, operation_id: str) -> HttpResponse:
    def act(op: Operation, data: dict[str, Any]) -> str:
        operation_dispute(operation_id=op.id, actor=request.user, reason=data["reason"],
                          seen_status_changed_at=data.get("seen"),
                          held_shown=data["held_shown"],
                          held_answers_shown=data["held_answers_shown"])
        return "Marked disputed: on hold until resolved."

    return _operator_action(
        request, operation_id, form_class=DecisionForm, prefix="dispute", verb="Dispute",
        incomplete="Give a reason to dispute.", act=act,
    )
