// The runs table: live status cells over the team's websocket, and the compare selection
// (ticked runs survive table swaps — filters, paging, live reloads — until compared).
(function () {
  "use strict";
  const C = window.Crucible;

  function setStatus(el, status) {
    el.textContent = status;
    el.className = el.className.replace(/status-\w+/, "status-" + status);
  }

  function liveRunsTable(team) {
    C.connect(() => `/ws/teams/${team}/runs`, (msg) => {
      if (msg.type !== "run_status") return;
      const cell = document.querySelector(`[data-run-status="${msg.run}"]`);
      if (cell) setStatus(cell, msg.status);
      else if (window.htmx) window.htmx.ajax("GET", location.pathname + location.search, "#runs");
    });
  }

  function compareSelection() {
    const form = document.getElementById("compare-form");
    if (!form) return;
    const max = parseInt(form.dataset.max || "10", 10);
    const chosen = new Set();
    const button = document.getElementById("compare-button");
    const count = document.getElementById("compare-count");
    const hint = document.getElementById("compare-hint");
    const sync = () => {
      form.querySelectorAll('input[name="run"]').forEach((box) => { box.checked = chosen.has(box.value); });
      count.textContent = chosen.size;
      button.disabled = chosen.size < 2 || chosen.size > max;
      hint.textContent = chosen.size > max ? `Compare takes at most ${max} runs; untick ${chosen.size - max}.`
        : `Tick up to ${max} runs to compare them.`;
    };
    form.addEventListener("change", (e) => {
      if (e.target.name !== "run") return;
      if (e.target.checked) chosen.add(e.target.value); else chosen.delete(e.target.value);
      sync();
    });
    form.addEventListener("submit", (e) => {
      // Runs ticked on other pages are not in the DOM any more: send the whole set.
      e.preventDefault();
      const q = new URLSearchParams();
      chosen.forEach((id) => q.append("run", id));
      location.href = form.action + "?" + q.toString();
    });
    document.body.addEventListener("htmx:afterSwap", sync);
    sync();
  }

  // Adding a metric column reloads the page so the chooser lists it (to untick later).
  function metricPicker() {
    const picker = document.querySelector("[data-metric-picker]");
    if (!picker) return;
    picker.addEventListener("change", (e) => {
      e.stopPropagation();
      if (!picker.value) return;
      const q = new URLSearchParams(new FormData(picker.form));
      location.href = picker.form.action + "?" + q.toString();
    }, true);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const opts = C.data("runs-table-data");
    if (!opts) return;
    metricPicker();
    liveRunsTable(opts.team);
    compareSelection();
  });
})();
