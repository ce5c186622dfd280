// Compare: one chart per metric, one line per run (static/js/charts.js), sharing the
// smoothing / log / x controls, the crosshair and the zoom; and the config-diff toggle.
(function () {
  "use strict";
  const C = window.Crucible;
  const { ChartGroup, Chart, controls, buildAll } = C.charts;
  const PALETTE = ["#2f55d4", "#d4462f", "#17844a", "#9b3fd0", "#c77800", "#0f8a9d",
                   "#d43f8d", "#5b6474", "#6b8e23", "#8b4513"];
  const EXPERT = /^moe\/layer(\d+)\/expert(\d+)_tokens$/;
  const ORDER = [/^(reward|eval\/reward)/, /^eval\//, /loss/, /(^|\/)(kl|entropy|clip_frac|ratio)/,
                 /tokens_per_s|_per_s$/, /stale|lag|version/, /^(lr|grad_norm)$/, /^moe\//];
  const rank = (n) => { const i = ORDER.findIndex((re) => re.test(n)); return i < 0 ? 99 : i; };

  function compare(opts) {
    const { team, runs } = opts;
    document.querySelectorAll(".run-legend .swatch").forEach((el) => {
      el.style.background = PALETTE[+el.dataset.index % PALETTE.length];
    });
    const toggle = document.getElementById("show-all-keys");
    const table = document.getElementById("config-table");
    if (toggle && table) toggle.addEventListener("change", () => table.classList.toggle("only-diff", !toggle.checked));
    const container = document.getElementById("compare-charts");
    if (!container) return;
    const group = new ChartGroup("compare");
    controls(document.getElementById("chart-controls"), group);
    Promise.all(runs.map((r) => fetch(`/api/v1/teams/${team}/runs/${r.id}/metrics?layout=columns&max_points=${opts.points || 1000}`,
                                      { credentials: "same-origin" }).then((x) => (x.ok ? x.json() : { series: [] }))))
      .then((bodies) => {
        const names = new Set();
        bodies.forEach((b) => (b.series || []).forEach((s) => { if (!EXPERT.test(s.name)) names.add(s.name); }));
        container.replaceChildren();
        if (!names.size) {
          const p = document.createElement("p");
          p.className = "empty";
          p.textContent = "None of these runs has reported metrics yet.";
          container.appendChild(p);
          return;
        }
        const made = [];
        [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b)).forEach((name) => {
          const series = [];
          bodies.forEach((b, i) => {
            const s = (b.series || []).find((x) => x.name === name);
            if (!s) return;
            series.push({ label: runs[i].label, color: PALETTE[i % PALETTE.length],
                          steps: s.columns.step, walls: s.columns.wall, values: s.columns.last });
          });
          made.push(group.add(new Chart(container, name, series)));
        });
        buildAll(made);
        document.body.dataset.chartsReady = String(made.length);
      });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const opts = C.data("compare-data");
    if (opts) compare(opts);
  });
})();
