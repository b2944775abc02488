from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from approvals.forms import ApproveForm, QueueFilterForm, RejectForm
from approvals.models import Approval
from approvals.selectors import (
    approval_counts,
    approval_for_user,
    approval_is_own_intent,
    approval_policy_moved_to,
    approval_replaced_by,
    approval_replacement_changed,
    approval_run_mode_problem,
    approvals_for_user,
    approvals_of_operation,
    approvals_queue_page,
    last_approved_ancestors,
    live_launchers_allowed,
)
from approvals.services import (
    ApprovalRefused,
    approval_approve,
    approval_decision_check,
    approval_reject,
)
from operations.forms import form_problem
from operations.htmx import (
    fragment_requested,
    page_render,
    page_unmasking,
    unmasked_never_cached,
)
from operations.intents import (
    deal_found_rows,
    intent_diff,
    intent_rows,
    intent_summary,
    words_given_back,
)
from operations.models import Action, Operation, Run
from operations.selectors import (
    command_effects_in_runs,
    operation_lineage,
    runs_ancestors,
    tenant_perm_held,
    tenants_for_user,
)

QUEUE_PAGE_SIZE = 20

# The runs an intent's run derives from, nearest first, and the same command's operations in
# them that made their effect or may yet.
Derivation = tuple[list[str], list[Operation]]


def _derivations(approvals: list[Approval]) -> dict[str, Derivation]:
    """By operation id, for a whole page at once: a query per card (and per generation)
    made a page of replays' intents cost hundreds."""
    runs: dict[str, Run] = {}
    for approval in approvals:
        run = operation_lineage(approval.operation).run
        if run is not None and run.parent_run_id:
            runs[approval.operation_id] = run
    ancestors = runs_ancestors(runs.values())
    run_ids = {op_id: ancestors[run.id] for op_id, run in runs.items()}
    effects = command_effects_in_runs(
        [approval.operation for approval in approvals], run_ids=run_ids
    )
    return {op_id: (run_ids.get(op_id, []), effects[op_id]) for op_id in effects}


def _card(
    approval: Approval, *, user, unmasked: bool, can_decide: bool,
    derivation: Derivation | None = None, last_approved: dict[str, Operation] | None = None,
    launchers_allowed: set[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """`derivation`, `last_approved` (by operation id, as last_approved_ancestors reads
    them) and `launchers_allowed` (live_launchers_allowed): this card's among those the
    caller read for a whole page."""
    op = approval.operation
    if derivation is None:
        derivation = _derivations([approval])[op.id]
    ancestors, earlier_effects = derivation
    now = timezone.now()
    summary = intent_summary(action=op.action, payload=op.payload, unmasked=unmasked)
    lineage = operation_lineage(op)
    old = lineage.supersedes
    replaced_by_request, replaced_by = approval_replaced_by(approval)
    # What a person approved last is what the approver must see the changes against: a
    # change whose request ran out undecided, asked again unchanged, would otherwise never
    # be shown to anyone who decides. With none ever approved, the intent it replaces, whose
    # request (and a rejection's reason) the card names.
    compared_with = None
    if old is not None:
        if last_approved is None:
            last_approved = last_approved_ancestors([op])
        compared_with = last_approved.get(op.id, old)
    diff = []
    if compared_with is not None:
        diff = intent_diff(
            action=op.action, old_payload=compared_with.payload, new_payload=op.payload,
            old_policy=compared_with.policy_version, new_policy=op.policy_version,
            unmasked=unmasked,
        )
    return {
        "approval": approval,
        "op": op,
        # A replay's or a branch's intent: the approver sees which run it repeats, and
        # whether that run already made this command's effect (its new key dedups nothing).
        "derived_from": ancestors[0] if ancestors else "",
        "earlier_effects": earlier_effects,
        "action_label": Action(op.action).label if op.action in Action.values else op.action,
        "summary": summary,
        "rows": intent_rows(action=op.action, payload=op.payload, unmasked=unmasked),
        "unmasked": unmasked,
        "diff": diff,
        "compared_with": compared_with,
        "compared_approved": compared_with is not None and op.id in last_approved,
        # "Asked again, unchanged" is said only of the very intent it is compared with.
        "unchanged": compared_with is not None and not diff
        and compared_with.payload_hash == op.payload_hash,
        # The intent it replaces met a version conflict: the deal as the CRM then held it,
        # beside this intent's change, so the approver sees what the change now meets.
        "deal_found": deal_found_rows(
            action=op.action, payload=op.payload, result=old.result, unmasked=unmasked
        ) if old is not None else [],
        "lineage": lineage,
        # The replaced intent's last request: superseded by this one, or rejected or expired
        # before the agent changed the intent (then the approver needs its reason most).
        # .all() keeps the queue's prefetch; Approval's default ordering is newest first.
        "supersedes_approval": next(iter(old.approvals.all()), None) if old else None,
        # A superseded request's successors, within the tenant like the rest of its lineage.
        "replaced_by_request": replaced_by_request,
        "replaced_by": replaced_by,
        # A superseded request replaced by the very same intent, asked again, was not changed.
        "replacement_changed": approval_replacement_changed(
            approval, request=replaced_by_request, successor=replaced_by
        ),
        "expired_in_fact": approval.ran_out(now),
        "can_decide": can_decide and approval.is_pending and not approval.ran_out(now),
        # Approving would be refused: the card says so and leaves the approver Reject,
        # which tells the agent why.
        "policy_in_force": approval_policy_moved_to(approval) if approval.is_pending else "",
        # Likewise when the engine would never make the call, the run's mode forbidding it.
        "run_mode_problem": approval_run_mode_problem(
            approval, launchers_allowed=launchers_allowed
        ) if approval.is_pending else "",
        # Four eyes: approving would be refused; the card says who must, and keeps Reject.
        "own_intent": approval_is_own_intent(approval, user),
        "error": "",
        "notice": "",
        # What was typed into a decision refused for its words, by field (comment, reason).
        "draft": {},
    }


def _cards(user, approvals: list[Approval]) -> list[dict[str, Any]]:
    """Masked cards, as every list and htmx answer shows them."""
    deciding_ids = set(tenants_for_user(user, "approve_intents").values_list("id", flat=True))
    derivations = _derivations(approvals)
    last_approved = last_approved_ancestors(approval.operation for approval in approvals)
    launchers_allowed = live_launchers_allowed(approvals)
    return [
        _card(approval, user=user, unmasked=False,
              can_decide=approval.operation.tenant_id in deciding_ids,
              derivation=derivations[approval.operation_id], last_approved=last_approved,
              launchers_allowed=launchers_allowed)
        for approval in approvals
    ]


@require_GET
def queue(request: HttpRequest) -> HttpResponse:
    tenants = list(tenants_for_user(request.user).order_by("slug"))
    tenant_ids = [tenant.id for tenant in tenants]
    form = QueueFilterForm(request.GET, tenants=tenants)
    if form.is_valid():
        qs = approvals_for_user(request.user, filters=form.filters(), tenant_ids=tenant_ids)
        cursor = form.cleaned_data["cursor"]
    else:
        # A filter the user may not use (another tenant's slug) shows nothing, not everything.
        qs, cursor = Approval.objects.none(), ""
    page, next_cursor = approvals_queue_page(qs, cursor=cursor, size=QUEUE_PAGE_SIZE)
    query = request.GET.copy()
    query.pop("cursor", None)
    context = {
        "form": form,
        "cards": _cards(request.user, page),
        "counts": approval_counts(qs),
        "cursor": cursor,
        "next_cursor": next_cursor,
        "query": query.urlencode(),
        "here": request.get_full_path(),
    }
    return page_render(request, "approvals/queue.html", context, partial="rows")


@require_GET
# A fragment or the page from one URL: a cache must never hand out one for the other.
@vary_on_headers("HX-Request", "HX-History-Restore-Request")
def detail(request: HttpRequest, approval_id: str) -> HttpResponse:
    approval = approval_for_user(request.user, approval_id, "view_tenant")
    tenant = approval.operation.tenant
    unmasked, may_unmask = page_unmasking(
        request, tenant, action="approval.view_unmasked", object_type="approval",
        object_id=approval.id, reason=request.path, after={"approvals": [approval.id]},
    )
    card = _card(approval, user=request.user, unmasked=unmasked,
                 can_decide=tenant_perm_held(request.user, "approve_intents", tenant))
    card["may_unmask"] = may_unmask
    context = _detail_context(card, here=request.get_full_path())
    # htmx's history restore also says HX-Request, but it needs the whole page.
    template = (
        "approvals/queue.html#card" if fragment_requested(request) else "approvals/detail.html"
    )
    return unmasked_never_cached(render(request, template, context), unmasked=unmasked)


def _detail_context(card: dict[str, Any], *, here: str) -> dict[str, Any]:
    replaced = card["lineage"].supersedes
    history = approvals_of_operation(replaced.id) if replaced else []
    return {"card": card, "history": history, "here": here}


def _next_url(request: HttpRequest, approval: Approval) -> str:
    candidate = request.POST.get("next", "")
    # A path on this site, as the card writes it (the page it is on): redirect() would take
    # anything else for a view's name, and an unknown one raised after the decision was made.
    if candidate.startswith("/") and url_has_allowed_host_and_scheme(
        candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        # Back masked: an unmasked page is shown once, when asked for, and audited as such;
        # a decision taken on it is not a second request to see the values.
        parts = urlsplit(candidate)
        query = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True)
                 if key != "unmasked"]
        return urlunsplit(parts._replace(query=urlencode(query)))
    return reverse("approvals:detail", args=[approval.id])


# Refusals of a decision for its words alone: the approval is still pending, and the same
# decision in other words may yet be taken.
WORDS_REFUSED = frozenset({"secret_in_text", "no_reason"})


def _draft(typed: dict[str, str]) -> dict[str, str]:
    """What was typed into a decision refused for its words, to give back to correct. Text
    refused for a card number comes back as the page shows people's words, the number cut
    to its last four digits; text that would still show card data or a secret, not at all."""
    draft = {}
    for name, text in typed.items():
        given_back = words_given_back(text.strip())
        if given_back:
            draft[name] = given_back
    return draft


def _decided(
    request: HttpRequest, approval: Approval, *, error: str = "", notice: str = "",
    draft: dict[str, str] | None = None,
) -> HttpResponse:
    """htmx: the card, swapped in place (its textareas are hx-preserve'd). Without JS: a
    message and a redirect (PRG); or, for a decision refused for its words (`draft`: what
    was typed), the approval's page again with the refusal and the words to correct."""
    if request.htmx:
        fresh = approval_for_user(request.user, approval.id, "view_tenant")
        # The decision views already required approve_intents on this tenant.
        card = _card(fresh, user=request.user, unmasked=False, can_decide=True)
        card.update(error=error, notice=notice)
        response = render(
            request, "approvals/queue.html#card",
            {"card": card, "here": request.POST.get("next", "")},
        )
        # The queue's counts refresh themselves on this event; after a refusal too, since
        # it usually means someone else decided meanwhile.
        response["HX-Trigger"] = "approvals-changed"
        return response
    if error and draft is not None:
        # A redirect would lose what was typed. Masked: this is not the audited unmasked view.
        tenant = approval.operation.tenant
        card = _card(
            approval_for_user(request.user, approval.id, "view_tenant"), user=request.user,
            unmasked=False, can_decide=True,
        )
        card.update(error=error, draft=_draft(draft),
                    may_unmask=tenant_perm_held(request.user, "view_unmasked", tenant))
        context = _detail_context(card, here=_next_url(request, approval))
        return render(request, "approvals/detail.html", context, status=400)
    if error:
        messages.error(request, error)
    else:
        messages.success(request, notice)
    return redirect(_next_url(request, approval))


def _form_refused(
    request: HttpRequest, approval: Approval, form: forms.Form, *, verb: str
) -> HttpResponse:
    """Words the form turns away, on an approval that could take no decision anyway
    (expired, decided meanwhile): that is what the person is told, and the attempt is
    recorded, as a decision with valid words would be. Otherwise the words are given back
    to correct."""
    try:
        approval_decision_check(approval_id=approval.id, actor=request.user, verb=verb)
    except ApprovalRefused as refusal:
        return _decided(request, approval, error=refusal.message)
    typed = {name: str(form[name].value() or "") for name in form.fields}
    return _decided(request, approval, error=form_problem(form), draft=typed)


@require_POST
def approve(request: HttpRequest, approval_id: str) -> HttpResponse:
    approval = approval_for_user(request.user, approval_id, "approve_intents")
    form = ApproveForm(request.POST)
    if not form.is_valid():
        # Never approve while dropping what the approver wrote.
        return _form_refused(request, approval, form, verb="approve")
    try:
        approval_approve(
            approval_id=approval.id, actor=request.user, comment=form.cleaned_data["comment"]
        )
    except ApprovalRefused as refusal:
        return _decided(request, approval, error=refusal.message, draft=(
            {"comment": form.cleaned_data["comment"]} if refusal.code in WORDS_REFUSED else None
        ))
    return _decided(request, approval, notice="Approved; the operation is queued to run.")


@require_POST
def reject(request: HttpRequest, approval_id: str) -> HttpResponse:
    approval = approval_for_user(request.user, approval_id, "approve_intents")
    form = RejectForm(request.POST)
    if not form.is_valid():
        return _form_refused(request, approval, form, verb="reject")
    try:
        approval_reject(
            approval_id=approval.id, actor=request.user, reason=form.cleaned_data["reason"]
        )
    except ApprovalRefused as refusal:
        return _decided(request, approval, error=refusal.message, draft=(
            {"reason": form.cleaned_data["reason"]} if refusal.code in WORDS_REFUSED else None
        ))
    return _decided(request, approval, notice="Rejected; the operation is cancelled.")
