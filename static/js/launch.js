// Launch form: changing the kind swaps in that kind's starter config (a train config left
// under a profile run is only an error to fix), and says so next to the config box.
(function () {
  "use strict";
  document.addEventListener("DOMContentLoaded", () => {
    const data = window.Crucible.data("launch-data");
    const kind = document.getElementById("id_kind");
    const config = document.getElementById("id_config");
    if (!data || !kind || !config) return;
    let note = document.getElementById("config-reset-note");
    kind.addEventListener("change", () => {
      const starter = data.starters[kind.value];
      config.value = starter === undefined ? "{}" : starter;
      if (!note) {
        note = document.createElement("p");
        note.id = "config-reset-note";
        note.className = "help";
        note.setAttribute("role", "status");
        config.insertAdjacentElement("afterend", note);
      }
      note.textContent = `Config reset to the ${kind.value} starter.`;
    });
  });
})();
