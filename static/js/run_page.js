// The run page: charts (static/js/charts.js) loaded once from the metrics API, then grown
// from the run's websocket stream; expert heatmaps; the event log; and the server-rendered
// parts of the page (header, summary, checkpoints, attempts, samples) fetched again when
// the run's status changes, a checkpoint or report arrives, or (throttled) while metrics
// flow, so a page left open never shows a stale status or offers a stale action.
(function () {
  "use strict";
  const C = window.Crucible;
  const { ChartGroup, Chart, controls, observe, buildAll } = C.charts;

  // Metric names → the chart group they belong to (first match wins).
  const GROUPS = [
    ["Reward", /^(reward|eval\/reward)/],
    ["Evaluation", /^eval\//],
    ["Loss", /(^|\/)(loss|pg_loss|aux_loss|dpo_loss|dpo_acc|dpo_pairs)$|loss/],
    ["KL & entropy", /(^|\/)(kl|entropy|clip_frac|ratio)/],
    ["Throughput", /tokens_per_s|completion_len|_per_s$|throughput/],
    ["Staleness", /stale|lag|off_policy|version/],
    ["Optimizer", /^(lr|grad_norm|dropped_microbatches)$/],
    ["Router", /^moe\//],
  ];
  const ORDER = GROUPS.map(([g]) => g).concat(["Other"]);
  const groupOf = (name) => (GROUPS.find(([, re]) => re.test(name)) || ["Other"])[0];
  const EXPERT = /^moe\/layer(\d+)\/expert(\d+)_tokens$/;
  const COLOR = "#2f55d4";

  function groupBox(container, name) {
    const id = "group-" + name.toLowerCase().replace(/[^a-z]+/g, "-");
    let section = document.getElementById(id);
    if (!section) {
      section = document.createElement("section");
      section.id = id;
      section.className = "chart-group";
      section.dataset.group = name;
      const h = document.createElement("h3");
      h.textContent = name;
      section.appendChild(h);
      const grid = document.createElement("div");
      grid.className = "charts";
      section.appendChild(grid);
      const after = [...container.querySelectorAll(".chart-group")]
        .find((el) => ORDER.indexOf(el.dataset.group) > ORDER.indexOf(name));
      container.insertBefore(section, after || null);
    }
    return section.querySelector(".charts");
  }

  // One canvas per MoE layer: x = step, y = expert, shade = that expert's share of the
  // layer's routed tokens at that step.
  function heatmaps(container) {
    const layers = new Map();
    let pending = false;
    const draw = () => {
      pending = false;
      layers.forEach((layer, index) => {
        if (!layer.canvas) {
          const empty = document.getElementById("no-experts");
          if (empty) empty.remove();
          const fig = document.createElement("figure");
          fig.className = "heatmap";
          fig.dataset.layer = index;
          const cap = document.createElement("figcaption");
          fig.appendChild(cap);
          layer.canvas = document.createElement("canvas");
          layer.canvas.setAttribute("role", "img");
          fig.appendChild(layer.canvas);
          const figs = [...container.querySelectorAll("figure.heatmap")];
          container.insertBefore(fig, figs.find((f) => +f.dataset.layer > index) || null);
        }
        const steps = [...layer.byStep.keys()].sort((a, b) => a - b);
        const experts = layer.experts;
        const cw = Math.max(2, Math.min(12, Math.floor(560 / Math.max(1, steps.length))));
        const ch = 14;
        const c = layer.canvas;
        c.width = Math.max(1, steps.length) * cw;
        c.height = experts * ch;
        const ctx = c.getContext("2d");
        steps.forEach((step, x) => {
          const row = layer.byStep.get(step);
          const total = row.reduce((a, b) => a + (b || 0), 0) || 1;
          for (let e = 0; e < experts; e++) {
            const share = (row[e] || 0) / total;
            const shade = Math.round(255 - Math.min(1, share * experts / 2) * 215);
            ctx.fillStyle = `rgb(${shade},${shade},${Math.min(255, shade + 30)})`;
            ctx.fillRect(x * cw, e * ch, cw, ch);
          }
        });
        c.style.height = Math.max(64, experts * 16) + "px";
        const first = steps[0], last = steps[steps.length - 1];
        c.parentElement.querySelector("figcaption").textContent =
          `Layer ${index} · ${experts} experts · steps ${first}–${last}`;
        c.setAttribute("aria-label", `Expert utilisation, layer ${index}: ${experts} experts over ${steps.length} steps (${first} to ${last})`);
      });
    };
    return {
      add(name, step, value) {
        const m = EXPERT.exec(name);
        if (!m) return false;
        const l = +m[1], e = +m[2];
        if (!layers.has(l)) layers.set(l, { byStep: new Map(), experts: 0, canvas: null });
        const layer = layers.get(l);
        layer.experts = Math.max(layer.experts, e + 1);
        if (!layer.byStep.has(step)) layer.byStep.set(step, []);
        layer.byStep.get(step)[e] = value;
        if (!pending) { pending = true; requestAnimationFrame(draw); }
        return true;
      },
    };
  }

  function levelFilter(list) {
    const boxes = document.querySelectorAll('.level-filter input[name="level"]');
    const apply = () => boxes.forEach((b) => list.classList.toggle("hide-" + b.value, !b.checked));
    boxes.forEach((b) => b.addEventListener("change", apply));
    apply();
  }

  /** Replace the page's [data-live-part] elements with the server's current rendering. */
  function liveParts(url) {
    let inflight = false, again = false, last = 0, timer = null;
    const run = () => {
      if (inflight) { again = true; return; }
      inflight = true;
      last = Date.now();
      const q = new URLSearchParams(location.search);
      const sample = document.querySelector("#samples form.sample-controls");
      if (sample) new FormData(sample).forEach((v, k) => q.set(k, v));
      fetch(`${url}?${q}`, { credentials: "same-origin" })
        .then((r) => (r.ok ? r.text() : Promise.reject(r.status)))
        .then((html) => {
          const doc = new DOMParser().parseFromString(html, "text/html");
          doc.querySelectorAll("[data-live-part]").forEach((fresh) => {
            const old = document.getElementById(fresh.id);
            if (!old) return;
            // A part the reader is using (focus inside, e.g. the samples step picker) waits.
            if (old.contains(document.activeElement) && document.activeElement !== document.body) return;
            old.replaceWith(fresh);
            if (window.htmx) window.htmx.process(fresh);
            C.bind(fresh);
          });
          document.dispatchEvent(new CustomEvent("crucible:parts"));
        })
        .catch(() => {})
        .finally(() => {
          inflight = false;
          if (again) { again = false; run(); }
        });
    };
    return {
      now: run,
      // At most one refresh per ``ms`` (the summary's progress and ETA while steps arrive).
      soon(ms) {
        if (timer) return;
        const wait = Math.max(0, ms - (Date.now() - last));
        timer = setTimeout(() => { timer = null; run(); }, wait);
      },
    };
  }

  function liveRun(opts) {
    const container = document.getElementById("charts");
    const events = document.getElementById("events");
    const experts = heatmaps(document.getElementById("heatmaps"));
    const group = new ChartGroup("run-" + opts.run);
    const charts = new Map();
    let lastSeq = opts.after;
    const parts = liveParts(opts.parts);
    controls(document.getElementById("chart-controls"), group);
    levelFilter(events);

    const chartFor = (name) => {
      if (!charts.has(name)) {
        const empty = document.getElementById("no-metrics");
        if (empty) empty.remove();
        const chart = group.add(new Chart(groupBox(container, groupOf(name)), name,
          [{ label: name, color: COLOR, steps: [], walls: [], values: [] }]));
        const grid = chart.box.parentElement, section = grid.closest(".chart-group");
        const n = grid.children.length;
        section.style.flexGrow = n;
        section.style.flexBasis = Math.min(n, 3) * 370 + "px";
        charts.set(name, chart);
      }
      return charts.get(name);
    };

    let dirty = new Set(), pending = false;
    const flush = () => {
      pending = false;
      const todo = dirty;
      dirty = new Set();
      todo.forEach((c) => (c.plot ? c.refresh() : (c.rebuild(), observe(c))));
    };
    const touch = (c) => { dirty.add(c); if (!pending) { pending = true; requestAnimationFrame(flush); } };

    const appendPoints = (msg) => {
      const byChart = new Map();
      const now = Date.now() / 1000;
      for (let i = 0; i < msg.names.length; i++) {
        if (experts.add(msg.names[i], msg.steps[i], msg.values[i])) continue;
        const c = chartFor(msg.names[i]);
        if (!byChart.has(c)) byChart.set(c, [[], [], []]);
        const b = byChart.get(c);
        b[0].push(msg.steps[i]); b[1].push(msg.walls ? msg.walls[i] : now); b[2].push(msg.values[i]);
      }
      byChart.forEach((b, c) => { c.append(0, b[0], b[1], b[2]); touch(c); });
      if (byChart.size) parts.soon(5000);
    };

    const appendEvent = (msg) => {
      if (events.querySelector(`[data-seq="${msg.seq}"]`)) return;
      const li = document.createElement("li");
      li.dataset.seq = msg.seq;
      li.className = "lvl-" + msg.level;
      const seq = document.createElement("span");
      seq.className = "seq";
      seq.textContent = "#" + msg.seq;
      const time = document.createElement("time");
      time.textContent = new Date(msg.created_at).toTimeString().slice(0, 8);
      const text = document.createElement("span");
      text.className = "msg";
      text.textContent = msg.message;
      li.append(seq, " ", time, " ", text);
      events.appendChild(li);
      while (events.children.length > 500) events.firstElementChild.remove();
      events.scrollTop = events.scrollHeight;
      if (msg.kind === "status" && msg.data && msg.data.status) {
        // The badge changes at once; the rest of the header follows with the parts.
        const badge = document.getElementById("run-status");
        if (badge) {
          badge.textContent = msg.data.status;
          badge.className = badge.className.replace(/status-\w+/, "status-" + msg.data.status);
        }
      }
      if (msg.kind === "status" || msg.kind === "checkpoint" || msg.kind === "artifact") parts.now();
    };

    const onMessage = (msg) => {
      if (msg.seq !== undefined) lastSeq = Math.max(lastSeq, msg.seq);
      if (msg.type === "metrics") appendPoints(msg);
      else if (msg.type === "event") appendEvent(msg);
    };

    const url = `/api/v1/teams/${opts.team}/runs/${opts.run}/metrics?layout=columns&max_points=${opts.points}`;
    const t0 = performance.now();
    let connected = false;
    fetch(url, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : { series: [] }))
      .then((body) => {
        const t1 = performance.now();
        const made = [];
        for (const s of body.series || []) {
          const col = s.columns;
          if (EXPERT.test(s.name)) {
            col.step.forEach((st, i) => experts.add(s.name, st, col.last[i]));
            continue;
          }
          const c = chartFor(s.name);
          const series = c.series[0];
          series.steps = col.step; series.walls = col.wall; series.values = col.last;
          made.push(c);
        }
        buildAll(made);
        // Timings for the chart benchmark (tests/benchmarks/bench_charts.py): fetch and
        // parse, then creating and drawing every chart, up to the next frame.
        requestAnimationFrame(() => setTimeout(() => {
          window.__crucibleCharts = { charts: made.length, fetch_ms: t1 - t0, draw_ms: performance.now() - t1,
            points: made.reduce((n, c) => n + c.series[0].values.length, 0) };
          document.body.dataset.chartsReady = String(made.length);
        }));
      })
      .catch(() => { document.body.dataset.chartsReady = "error"; })
      .finally(() => {
        if (connected) return;
        connected = true;
        let opened = 0;
        C.connect(() => `/ws/teams/${opts.team}/runs/${opts.run}/stream?after=${lastSeq}`,
                  onMessage, document.getElementById("live-indicator"),
                  () => { if (opened++) parts.now(); }); // after a reconnect, catch up
      });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const opts = C.data("run-page-data");
    if (opts) liveRun(opts);
  });
})();
