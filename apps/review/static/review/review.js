// Review queue: keyboard-driven spot-checks.
//   j / ArrowDown  next item        k / ArrowUp  previous item
//   a              accept           r            reject (asks for a reason; Enter submits)
//   Escape         cancel a rejection
//   u              undo your last verdict (while its batch is still being decided)
// The focused open item is claimed (locked to you) through the API; moving on releases it.
// Verdicts go through the JSON API; the queue is then re-rendered by the server (htmx
// partial) so counts, the batch decision and other reviewers' locks are current.
(function () {
  "use strict";
  const root = document.getElementById("review");
  if (!root) return;
  const team = root.dataset.team;
  const csrf = root.dataset.csrf;
  const canReview = root.dataset.canReview === "1";
  const status = document.getElementById("review-status");
  const rejectForm = document.getElementById("reject-form");
  const rejectReason = document.getElementById("reject-reason");
  let selected = null;   // item id (string) shown and focused
  let claimed = null;    // item id we hold the lock on
  let busy = false;
  let lastJudged = null;  // item id of our last verdict, for undo
  const undoButton = () => document.getElementById("undo-btn");
  const syncUndo = () => { const b = undoButton(); if (b) b.disabled = !lastJudged || busy; };

  const items = () => Array.from(document.querySelectorAll("#items [data-item]"));
  const itemEl = (id) => document.getElementById("item-" + id);

  function say(text, isError) {
    status.textContent = text;
    status.classList.toggle("error", !!isError);
  }

  // One request at a time, in order: a verdict never overtakes the claim before it.
  let chain = Promise.resolve();
  function api(id, action, body) {
    const run = () => send(id, action, body);
    const result = chain.then(run, run);
    chain = result.catch(() => {});
    return result;
  }

  async function send(id, action, body) {
    const response = await fetch(`/api/v1/teams/${team}/review-items/${id}/${action}`, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
      body: JSON.stringify(body || {}),
    });
    let data = {};
    try { data = await response.json(); } catch (e) { /* empty body */ }
    if (!response.ok) throw new Error(data.message || `Request failed (${response.status}).`);
    return data;
  }

  function judgeable(el) {
    return el && el.dataset.status === "open" && el.dataset.batchOpen === "1" && !el.dataset.lockedBy;
  }

  function syncButtons() {
    const el = selected && itemEl(selected);
    const ok = canReview && judgeable(el) && !busy;
    for (const id of ["accept-btn", "reject-btn"]) {
      const button = document.getElementById(id);
      if (button) button.disabled = !ok;
    }
  }

  function show(id, focus) {
    selected = id;
    for (const el of items()) {
      const on = el.dataset.item === id;
      el.setAttribute("aria-selected", on ? "true" : "false");
      el.tabIndex = on ? 0 : -1;
    }
    document.querySelectorAll("[data-detail]").forEach((panel) => {
      panel.hidden = panel.dataset.detail !== id;
    });
    const el = itemEl(id);
    const list = document.getElementById("items");
    if (list && el) list.setAttribute("aria-activedescendant", el.id);
    if (el && focus) el.focus();
    if (el) el.scrollIntoView({ block: "nearest" });
    syncButtons();
  }

  async function select(id, focus = true) {
    if (!id) return;
    show(id, focus);
    if (claimed && claimed !== id) {
      const previous = claimed;
      claimed = null;
      api(previous, "release").catch(() => {});
    }
    const el = itemEl(id);
    if (!canReview || !judgeable(el) || claimed === id) return;
    try {
      await api(id, "claim");
      if (selected === id) claimed = id; else api(id, "release").catch(() => {});
    } catch (error) {
      say(error.message, true);
      el.dataset.lockedBy = "someone";
      syncButtons();
    }
  }

  function move(step) {
    const list = items();
    if (!list.length) return;
    const at = list.findIndex((el) => el.dataset.item === selected);
    const next = list[Math.min(list.length - 1, Math.max(0, at + step))];
    select(next.dataset.item);
  }

  function nextOpenAfter(id) {
    const list = items();
    const at = list.findIndex((el) => el.dataset.item === id);
    const after = list.slice(at + 1).concat(list.slice(0, at)).find(judgeable);
    return after ? after.dataset.item : id;
  }

  async function refresh(preferred) {
    const response = await fetch(location.pathname + location.search, {
      headers: { "HX-Request": "true" }, credentials: "same-origin",
    });
    if (!response.ok) return;
    const queue = document.getElementById("queue");
    queue.innerHTML = await response.text();
    if (window.htmx) window.htmx.process(queue);
    const target = itemEl(preferred) ? preferred : (items()[0] && items()[0].dataset.item);
    if (target) await select(target); else selected = null;
    syncUndo();
  }

  async function judge(verdict, reason) {
    const el = selected && itemEl(selected);
    if (!canReview || busy || !judgeable(el)) return;
    busy = true;
    syncButtons();
    const id = selected;
    const next = nextOpenAfter(id);
    try {
      const result = await api(id, "verdict", { verdict, reason: reason || "" });
      if (claimed === id) claimed = null;
      lastJudged = id;
      const batch = result.batch;
      say(`#${result.item.index} ${result.item.status}. Batch ${batch.status.replace("_", " ")}: ${batch.decision.reason}`);
      busy = false;
      await refresh(next);
      syncUndo();
    } catch (error) {
      busy = false;
      say(error.message, true);
      syncButtons();
    }
  }

  async function undo() {
    if (!canReview || busy || !lastJudged) return;
    busy = true;
    syncUndo();
    const id = lastJudged;
    try {
      const result = await api(id, "undo", {});
      lastJudged = null;
      say(`#${result.item.index} is open again (verdict undone). Batch ${result.batch.status.replace("_", " ")}.`);
      busy = false;
      await refresh(id);
    } catch (error) {
      busy = false;
      say(error.message, true);
    }
    syncUndo();
  }

  function openReject() {
    const el = selected && itemEl(selected);
    if (!canReview || !judgeable(el)) return;
    rejectForm.hidden = false;
    rejectReason.value = "";
    rejectReason.focus();
  }

  function closeReject() {
    rejectForm.hidden = true;
    const el = selected && itemEl(selected);
    if (el) el.focus();
  }

  rejectForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const reason = rejectReason.value.trim();
    if (!reason) { say("Say why the record is rejected: a reason is required.", true); return; }
    rejectForm.hidden = true;
    await judge("reject", reason);
  });
  document.getElementById("reject-cancel").addEventListener("click", closeReject);
  rejectReason.addEventListener("keydown", (event) => {
    if (event.key === "Escape") { event.preventDefault(); closeReject(); }
  });

  root.addEventListener("click", (event) => {
    const li = event.target.closest("#items [data-item]");
    if (li) { select(li.dataset.item); return; }
    if (event.target.closest("#accept-btn")) judge("accept");
    else if (event.target.closest("#reject-btn")) openReject();
    else if (event.target.closest("#undo-btn")) undo();
  });

  document.addEventListener("keydown", (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const tag = (event.target.tagName || "").toLowerCase();
    if (tag === "input" || tag === "textarea" || tag === "select" || event.target.isContentEditable) return;
    const handlers = {
      j: () => move(1), ArrowDown: () => move(1), k: () => move(-1), ArrowUp: () => move(-1),
      a: () => judge("accept"), r: () => openReject(), u: () => undo(),
      Escape: () => closeReject(),
    };
    const handler = handlers[event.key];
    if (!handler) return;
    event.preventDefault();
    handler();
  });

  // Other reviewers' claims and verdicts arrive on the team's live channel.
  let pending = null;
  try {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/teams/${team}/runs`);
    socket.addEventListener("message", (event) => {
      let msg;
      try { msg = JSON.parse(event.data); } catch (e) { return; }
      if (msg.type !== "review_item" && msg.type !== "review_batch") return;
      if (msg.by === root.dataset.user) return;  // our own claims and verdicts
      clearTimeout(pending);
      pending = setTimeout(() => {
        if (!busy && rejectForm.hidden) refresh(selected);
      }, 400);
    });
  } catch (e) { /* live updates are a nicety; the page works without them */ }

  const first = items().find(judgeable) || items()[0];
  if (first) select(first.dataset.item);
})();
