// Every form that changes something hard to undo (stop a run, cancel an experiment or a
// search) carries data-confirm: its question, asked before the form is sent. One handler for
// every page, loaded by base.html (the CSP allows no inline handlers).
(() => {
  "use strict";

  document.addEventListener("submit", (ev) => {
    const form = ev.target;
    if (form instanceof HTMLFormElement && form.dataset.confirm
        && !window.confirm(form.dataset.confirm)) ev.preventDefault();
  });
})();
