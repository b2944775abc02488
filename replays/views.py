"""The lineage browser: runs, their checkpoints, their effects, and where each came from."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from operations.htmx import fragment_requested, page_render
from operations.intents import intent_summary
from operations.selectors import (
    keyset_page,
    operation_lineage,
    run_ancestors,
    tenants_for_user,
)
from replays.forms import CheckpointPageForm, ConversationForm, RunFilterForm
from replays.selectors import (
    RunFilters,
    checkpoints_with_state_fields,
    run_checkpoints,
    run_children,
    run_for_user,
    run_operations,
    runs_page_for_user,
)

PAGE_SIZE = 50


@require_GET
def run_list(request: HttpRequest) -> HttpResponse:
    slugs = list(tenants_for_user(request.user).values_list("slug", flat=True))
    form = RunFilterForm(request.GET, tenant_slugs=slugs)
    if form.is_valid():
        runs, next_cursor = runs_page_for_user(
            request.user, filters=form.filters(), before=form.cleaned_data.get("before"),
            size=PAGE_SIZE,
        )
    else:
        # A filter the user may not use (another tenant's slug) shows nothing, not everything.
        runs, next_cursor = [], None
    query = request.GET.copy()
    query.pop("before", None)
    context = {"form": form, "runs": runs, "next_cursor": next_cursor,
               "query": query.urlencode()}
    return page_render(request, "replays/runs.html", context, partial="rows")


@require_GET
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    run = run_for_user(request.user, run_id)
    form = CheckpointPageForm(request.GET)
    if not form.is_valid():
        raise Http404("Not a page of this run's checkpoints")
    # A run that loops leaves thousands of checkpoints: the newest page, then older ones by
    # sequence, as the conversation page does with runs.
    checkpoints, older_checkpoints = keyset_page(
        run_checkpoints(run), before=form.cleaned_data["before"], size=PAGE_SIZE,
        key="sequence",
    )
    context = {
        "run": run,
        "checkpoints": checkpoints_with_state_fields(checkpoints),
        "older_checkpoints": older_checkpoints,
    }
    if not fragment_requested(request):
        # The newest of each; the journal and the run list, filtered by this run, page
        # through the rest.
        operations, older_operations = keyset_page(run_operations(run), before=None,
                                                   size=PAGE_SIZE)
        children, older_children = keyset_page(run_children(run), before=None,
                                               size=PAGE_SIZE)
        context |= {
            "ancestors": run_ancestors(run),
            "children": children,
            "older_children": older_children,
            # Lineage by the operation page's rule: never another tenant's intent, nor
            # another run's checkpoint (a row from before operations 0016 can name them).
            "operations": [
                (op, operation_lineage(op), intent_summary(action=op.action, payload=op.payload))
                for op in operations
            ],
            "older_operations": older_operations,
        }
    return page_render(request, "replays/run.html", context, partial="checkpoint_rows")


@require_GET
def conversation_detail(
    request: HttpRequest, conversation_id: str | None = None
) -> HttpResponse:
    if conversation_id is None:
        form = ConversationForm(request.GET)
        if not form.is_valid():
            # No id, or one no run can have (too long, a NUL byte PostgreSQL refuses).
            raise Http404("No such conversation")
        conversation_id = form.cleaned_data["id"]
    # The newest page only: an agent that loops can leave thousands of runs in one
    # conversation. The run list, filtered by it, pages through the rest.
    runs, next_cursor = runs_page_for_user(
        request.user, filters=RunFilters(conversation=conversation_id), before=None,
        size=PAGE_SIZE,
    )
    if not runs:
        # A conversation exists only through its runs: none visible is not found, whether it
        # is another tenant's or no one's.
        raise Http404("No such conversation")
    return render(request, "replays/conversation.html", {
        "conversation_id": conversation_id, "runs": runs, "next_cursor": next_cursor,
    })
