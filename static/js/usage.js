// The usage page's chart: GPU-hours (or core-hours) per UTC day, stacked by part, on uPlot
// (static/vendor/uplot-*). uPlot has no stacking of its own: each drawn series is the running
// sum of the parts up to it, drawn from the tallest down so each bar shows every part, and
// the legend shows each part's own value, not the running sum.
(function () {
  "use strict";
  const C = window.Crucible;
  const COLORS = { useful: "#17844a", startup: "#8fa3c7", restart: "#2f55d4",
                   lost_preemption: "#c77800", lost_failure: "#d4462f", held: "#9aa1ad" };
  const DAY = 86400;

  function draw(el, chart) {
    const xs = chart.days.map((d) => Date.parse(d + "T00:00:00Z") / 1000);
    const running = [];
    let sum = xs.map(() => 0);
    chart.parts.forEach((p) => {
      sum = sum.map((v, i) => v + p.values[i]);
      running.push(sum);
    });
    const order = chart.parts.map((_, i) => i).reverse(); // tallest first, useful on top
    const bars = uPlot.paths.bars({ size: [0.7, 60] });
    const fmt = (v) => (v == null ? "—" : v.toFixed(2));
    const opts = {
      width: Math.max(320, el.clientWidth || 800), height: 260,
      scales: { x: { time: true, range: (u, lo, hi) => [lo - DAY / 2, hi + DAY / 2] },
                y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.08 : 1] } },
      // One tick per day (at most ~12 labels), not uPlot's hourly time ticks.
      axes: [{ splits: () => xs.filter((_, i) => i % Math.ceil(xs.length / 12) === 0),
               values: (u, splits) => splits.map((v) => new Date(v * 1000).toISOString().slice(5, 10)) },
             { label: chart.unit, size: 60 }],
      series: [{ value: (u, v) => (v == null ? "—" : new Date(v * 1000).toISOString().slice(0, 10)) },
        ...order.map((i) => {
          const p = chart.parts[i];
          return { label: p.label, stroke: COLORS[p.key], fill: COLORS[p.key], width: 0,
                   paths: bars, points: { show: false },
                   value: (u, v, s, idx) => (idx == null ? "—" : fmt(p.values[idx])) };
        })],
      legend: { live: true },
    };
    const data = [xs, ...order.map((i) => running[i])];
    el.replaceChildren();
    const plot = new uPlot(opts, data, el);
    if (window.ResizeObserver) {
      new ResizeObserver(() => plot.setSize({ width: Math.max(320, el.clientWidth), height: 260 }))
        .observe(el);
    }
    el.dataset.ready = String(xs.length);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const chart = C.data("usage-chart-data");
    const el = document.getElementById("usage-chart");
    if (chart && el) draw(el, chart);
  });
})();
