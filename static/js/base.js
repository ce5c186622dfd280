// Behaviour every page shares, bound from data attributes so templates carry no inline
// script or on* handler (the Content-Security-Policy allows scripts from 'self' only):
//   <select data-navigate="/t/{value}/">     go to the URL with the chosen value
//   <form data-confirm="Remove …?">          ask before submitting
//   <button data-copy="#element-id">          copy that input's value to the clipboard
//   <select data-autosubmit>                  submit its form when the choice changes
// and the reconnecting websocket helper the live pages use.
(function () {
  "use strict";
  const C = (window.Crucible = window.Crucible || {});

  const wsBase = () => (location.protocol === "https:" ? "wss://" : "ws://") + location.host;

  /** One websocket that reconnects with backoff; ``path`` is re-read on every attempt so a
   * stream can resume from the last sequence number seen. */
  C.connect = function connect(path, onMessage, indicator, onOpen) {
    let retry = 500;
    const open = () => {
      const socket = new WebSocket(wsBase() + path());
      socket.onopen = () => {
        retry = 500;
        if (indicator) indicator.classList.add("on");
        if (onOpen) onOpen();
      };
      socket.onmessage = (e) => {
        let msg;
        try { msg = JSON.parse(e.data); } catch (err) { return; }
        onMessage(msg);
      };
      socket.onclose = () => {
        if (indicator) indicator.classList.remove("on");
        setTimeout(open, retry);
        retry = Math.min(retry * 2, 10000);
      };
    };
    open();
  };

  /** The JSON a template left in <script type="application/json" id=…> (json_script). */
  C.data = function data(id) {
    const el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  };

  function bind(root) {
    root.querySelectorAll("select[data-navigate]").forEach((el) => {
      if (el.__bound) return;
      el.__bound = true;
      el.addEventListener("change", () => {
        location.href = el.dataset.navigate.replace("{value}", encodeURIComponent(el.value));
      });
    });
    root.querySelectorAll("select[data-autosubmit]").forEach((el) => {
      if (el.__bound) return;
      el.__bound = true;
      el.addEventListener("change", () => el.form.requestSubmit());
    });
    root.querySelectorAll("button[data-copy]").forEach((el) => {
      if (el.__bound) return;
      el.__bound = true;
      el.addEventListener("click", () => {
        const src = document.querySelector(el.dataset.copy);
        if (!src) return;
        const done = () => { el.textContent = "Copied"; };
        if (navigator.clipboard) navigator.clipboard.writeText(src.value).then(done, () => { src.select(); });
        else { src.select(); }
      });
    });
  }

  // Delegated, so forms that htmx swaps in later are covered too.
  document.addEventListener("submit", (e) => {
    const form = e.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.dataset.confirm)) e.preventDefault();
  }, true);
  document.addEventListener("DOMContentLoaded", () => bind(document));
  document.addEventListener("htmx:afterSwap", (e) => bind(e.target));
  C.bind = bind;
})();
