// A list that refreshes itself (data-pause-while-typing) waits while anything in it has
// focus: re-rendering around a focused field scrolls the page back to that field (htmx
// refocuses a preserved element), and around a focused button or link drops a keyboard user
// back to the top of the page.
document.addEventListener("htmx:confirm", (event) => {
  const list = event.detail.elt;
  const active = document.activeElement;
  if (
    list.hasAttribute("data-pause-while-typing") &&
    active && active !== document.body && list.contains(active)
  ) {
    event.preventDefault();
  }
});

// A page's own refresh (data-poll: a poll, or the approval counts following a decision) says
// so: once the session has ended, the server answers it in place instead of sending the whole
// page to sign in, which would drop what was typed. Only the polling element's own requests:
// the links and forms inside it are the person's.
function isOwnRefresh(event) {
  return event.detail.elt.hasAttribute("data-poll");
}

document.addEventListener("htmx:configRequest", (event) => {
  if (isOwnRefresh(event)) {
    event.detail.headers["X-Console-Poll"] = "true";
  }
});

// A button whose press records something on a person's word alone asks first (data-confirm),
// unless the form's field named in data-confirm-unless holds something the server checks
// (a provider reference). Without JavaScript the form submits as it is.
document.addEventListener("htmx:confirm", (event) => {
  const trigger = event.detail.triggeringEvent;
  const button = trigger && trigger.submitter;
  if (!button || !button.dataset.confirm) return;
  const checked = button.dataset.confirmUnless && button.form &&
    button.form.elements.namedItem(button.dataset.confirmUnless);
  if (checked && checked.value.trim()) return;
  event.preventDefault();
  if (window.confirm(button.dataset.confirm)) event.detail.issueRequest(true);
});

// Back or Forward to a filtered list that htmx restores from its own history cache: the
// cached page keeps the rows of that URL but not its form controls' values (the browser
// saves attributes, and the form sits outside the swapped rows). Set them from the URL.
document.addEventListener("htmx:historyRestore", () => {
  const params = new URLSearchParams(window.location.search);
  for (const form of document.querySelectorAll("form.filters")) {
    for (const field of form.elements) {
      if (field.name && field.type !== "submit" && field.type !== "hidden") {
        field.value = params.get(field.name) ?? "";
      }
    }
  }
});

// A swap that removed the focused element (the Approve button, Resolve, Older…) would drop
// keyboard and screen-reader users on <body>, at the top of the page, hearing nothing. Put
// focus on what the answer says (its alert or status), else on the first control of the new
// content. Polls never get here: the lists pause while anything in them has focus.
const heldFocus = new WeakSet();
document.addEventListener("htmx:beforeSwap", (event) => {
  const active = document.activeElement;
  if (active && active !== document.body && event.detail.target.contains(active)) {
    heldFocus.add(event.detail.target);
  }
});
document.addEventListener("htmx:afterSettle", (event) => {
  if (!heldFocus.delete(event.detail.target)) return;
  const active = document.activeElement;
  if (active && active !== document.body && active.isConnected) return;  // htmx kept it
  const target = event.detail.target;
  const root = target.isConnected ? target : target.id && document.getElementById(target.id);
  if (!root) return;
  const spot = root.querySelector("[role=alert], [role=status]")
    || root.querySelector("a[href], button, textarea, input, select");
  if (!spot) return;
  if (!spot.matches("a[href], button, textarea, input, select")) spot.tabIndex = -1;
  spot.focus();
});

// A request the server refused before doing anything (403: a role taken away, or a page
// loaded before the person signed in again, here or in another tab; 404) or that failed
// (5xx, no answer) is not swapped by htmx: the button, or the Older / Next page link or the
// filter, would seem to do nothing at all, and the approver could not tell whether the
// payment was approved. Say it in words where they clicked, with the server's own words when
// its page carries them ([data-refusal]). A page's own refresh stays quiet: the next one
// tries again.
function showRequestProblem(event, text) {
  const elt = event.detail.elt;
  const target = event.detail.target;
  let spot = elt.closest("form") || elt;
  if (target && target.contains(spot)) {
    for (const old of target.querySelectorAll(".request-problem")) old.remove();
    while (spot.parentElement && spot.parentElement !== target) spot = spot.parentElement;
  }
  const problem = document.createElement("p");
  problem.className = "error request-problem";
  problem.setAttribute("role", "alert");
  problem.tabIndex = -1;
  problem.textContent = text;
  spot.before(problem);
  problem.focus();
}

// A GET changes nothing: the person is told it did not come, not whether something was done.
function isRead(event) {
  const verb = event.detail.requestConfig && event.detail.requestConfig.verb;
  return !verb || verb.toLowerCase() === "get";
}

document.addEventListener("htmx:responseError", (event) => {
  if (isOwnRefresh(event)) return;
  const xhr = event.detail.xhr;
  const refusal = new DOMParser()
    .parseFromString(xhr.responseText || "", "text/html")
    .querySelector("[data-refusal]");
  const words = refusal ? refusal.textContent.trim().replace(/\s+/g, " ") : "";
  const refused = words || `The console refused it (HTTP ${xhr.status}).`;
  if (isRead(event)) {
    showRequestProblem(event, xhr.status < 500
      ? `This did not load. ${refused}`
      : `The console failed to answer this (HTTP ${xhr.status}). Try again, or reload the page.`);
    return;
  }
  showRequestProblem(event, xhr.status < 500
    ? `Nothing was done. ${refused}`
    : `The console failed while doing this (HTTP ${xhr.status}). Reload the page to see ` +
      "whether it was done.");
});

document.addEventListener("htmx:sendError", (event) => {
  if (isOwnRefresh(event)) return;
  showRequestProblem(event, isRead(event)
    ? "No answer from the console. Try again, or reload the page."
    : "No answer from the console: the request may not have arrived, or its answer was " +
      "lost. Reload the page to see whether it was done.");
});
