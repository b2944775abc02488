// A list that refreshes itself (data-pause-while-typing) waits while a person types in it:
// re-rendering around a focused field scrolls the page back to that field (htmx refocuses
// a preserved element), away from whatever they had scrolled on to read.
document.addEventListener("htmx:confirm", (event) => {
  const list = event.detail.elt;
  const active = document.activeElement;
  if (
    list.hasAttribute("data-pause-while-typing") &&
    active && list.contains(active) && active.matches("textarea, input, select")
  ) {
    event.preventDefault();
  }
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
