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
