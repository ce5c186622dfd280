// Live dashboard: one websocket per page, reconnecting with the last sequence number
// seen so the server replays exactly what was missed. Charts are uPlot.
(function () {
  "use strict";
  const wsBase = () => (location.protocol === "https:" ? "wss://" : "ws://") + location.host;

  function connect(path, onMessage, indicator) {
    let socket = null, retry = 500;
    const open = () => {
      socket = new WebSocket(wsBase() + path());
      socket.onopen = () => { retry = 500; if (indicator) indicator.classList.add("on"); };
      socket.onmessage = (e) => onMessage(JSON.parse(e.data));
      socket.onclose = () => {
        if (indicator) indicator.classList.remove("on");
        setTimeout(open, retry);
        retry = Math.min(retry * 2, 10000);
      };
    };
    open();
  }

  function setStatus(el, status) {
    if (!el) return;
    el.textContent = status;
    el.className = el.className.replace(/status-\w+/, "status-" + status);
  }

  function liveRunsTable(team) {
    connect(() => `/ws/teams/${team}/runs`, (msg) => {
      if (msg.type !== "run_status") return;
      const cell = document.querySelector(`[data-run-status="${msg.run}"]`);
      if (cell) setStatus(cell, msg.status);
      else if (window.htmx) htmx.ajax("GET", location.pathname + location.search, "#runs");
    });
  }

  // Ticked runs survive table swaps (filters, paging, live reloads) until compared.
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

  // --- run page -----------------------------------------------------------------------
  // Metric names → the chart group they belong to (first match wins).
  const GROUPS = [
    ["Reward", /^(reward|eval\/reward)/],
    ["Loss", /(^|\/)(loss|pg_loss|aux_loss|dpo_loss|dpo_acc|dpo_pairs)$|loss/],
    ["KL & entropy", /(^|\/)(kl|entropy|clip_frac)/],
    ["Throughput", /tokens_per_s|completion_len|_per_s$|throughput/],
    ["Staleness", /stale|lag|off_policy|version/],
    ["Optimizer", /^(lr|grad_norm|dropped_microbatches)$/],
    ["Router", /^moe\//],
    ["Evaluation", /^eval\//],
  ];
  const groupOf = (name) => (GROUPS.find(([, re]) => re.test(name)) || ["Other"])[0];
  const EXPERT = /^moe\/layer(\d+)\/expert(\d+)_tokens$/;

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
      // Keep groups in the declared order.
      const order = GROUPS.map(([g]) => g).concat(["Other"]);
      const after = [...container.querySelectorAll(".chart-group")]
        .find((el) => order.indexOf(el.dataset.group) > order.indexOf(name));
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
          cap.textContent = `Layer ${index}`;
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

  // Charts follow their box's width (window resizes, groups reflowing).
  const resizer = window.ResizeObserver ? new ResizeObserver((entries) => {
    for (const entry of entries) {
      const plot = entry.target.__plot;
      const width = Math.max(200, Math.floor(entry.contentRect.width) - 8);
      if (plot && Math.abs(plot.width - width) > 4) plot.setSize({ width, height: plot.height });
    }
  }) : null;
  const fit = (box, plot) => { box.__plot = plot; if (resizer) resizer.observe(box); };

  function makeChart(container, name) {
    // Groups share a row: a group grows with its number of charts (up to three wide).
    const group = container.closest(".chart-group");
    if (group) {
      const n = container.children.length + 1;
      group.style.flexGrow = n;
      group.style.flexBasis = Math.min(n, 3) * 370 + "px";
    }
    const box = document.createElement("figure");
    box.className = "chart";
    box.dataset.metric = name;
    const caption = document.createElement("figcaption");
    caption.textContent = name;
    box.appendChild(caption);
    container.appendChild(box);
    const data = [[], [], [], []];  // steps, last, min, max
    const width = Math.max(280, Math.floor(box.clientWidth || 420) - 8);
    const plot = new uPlot({
      width, height: 200,
      scales: { x: { time: false } },
      legend: { show: false },
      series: [
        { label: "step" },
        { label: name, stroke: "#3056d3", width: 2 },
        { label: "min", stroke: "rgba(48,86,211,.25)", width: 1 },
        { label: "max", stroke: "rgba(48,86,211,.25)", width: 1 },
      ],
      axes: [{ stroke: "#5b6474" }, { stroke: "#5b6474" }],
    }, data, box);
    fit(box, plot);
    return { box, plot, data, lastStep: -Infinity };
  }

  function liveRun(opts) {
    const charts = new Map();
    const container = document.getElementById("charts");
    const events = document.getElementById("events");
    const statusEl = document.getElementById("run-status");
    const experts = heatmaps(document.getElementById("heatmaps"));
    let lastSeq = opts.after;
    levelFilter(events);

    const chartFor = (name) => {
      if (!charts.has(name)) {
        const empty = document.getElementById("no-metrics");
        if (empty) empty.remove();
        charts.set(name, makeChart(groupBox(container, groupOf(name)), name));
      }
      return charts.get(name);
    };
    const redraw = (c) => c.plot.setData(c.data);

    const appendPoints = (names, steps, values) => {
      const touched = new Set();
      for (let i = 0; i < names.length; i++) {
        if (experts.add(names[i], steps[i], values[i])) continue;
        const c = chartFor(names[i]);
        if (steps[i] <= c.lastStep) continue;  // already covered by the downsampled load
        c.data[0].push(steps[i]); c.data[1].push(values[i]);
        c.data[2].push(values[i]); c.data[3].push(values[i]);
        c.lastStep = steps[i];
        touched.add(c);
      }
      touched.forEach(redraw);
    };

    const appendEvent = (msg) => {
      if (events.querySelector(`[data-seq="${msg.seq}"]`)) return;
      const li = document.createElement("li");
      li.dataset.seq = msg.seq;
      li.className = "lvl-" + msg.level;
      const time = new Date(msg.created_at).toTimeString().slice(0, 8);
      li.innerHTML = `<span class="seq">#${msg.seq}</span> <time>${time}</time> <span class="msg"></span>`;
      li.querySelector(".msg").textContent = msg.message;
      events.appendChild(li);
      while (events.children.length > 500) events.firstElementChild.remove();
      events.scrollTop = events.scrollHeight;
      if (msg.kind === "status" && msg.data && msg.data.status) {
        setStatus(statusEl, msg.data.status);
        if (msg.data.status === "failed") {
          const err = document.getElementById("run-error");
          err.hidden = false;
          err.textContent = msg.message;
        }
      }
    };

    const onMessage = (msg) => {
      if (msg.seq !== undefined) lastSeq = Math.max(lastSeq, msg.seq);
      if (msg.type === "metrics") appendPoints(msg.names, msg.steps, msg.values);
      else if (msg.type === "event") appendEvent(msg);
    };

    const base = `/api/v1/teams/${opts.team}/runs/${opts.run}`;
    fetch(`${base}/metrics?max_points=500`, { credentials: "same-origin" })
      .then((r) => r.json())
      .then((body) => {
        for (const s of body.series || []) {
          if (EXPERT.test(s.name)) {
            for (const p of s.points) experts.add(s.name, p.step, p.last);
            continue;
          }
          const c = chartFor(s.name);
          for (const p of s.points) {
            c.data[0].push(p.step); c.data[1].push(p.last);
            c.data[2].push(p.min); c.data[3].push(p.max);
            c.lastStep = p.step;
          }
          redraw(c);
        }
      })
      .finally(() => connect(() => `/ws/teams/${opts.team}/runs/${opts.run}/stream?after=${lastSeq}`,
                             onMessage, document.getElementById("live-indicator")));
  }

  // --- compare: one chart per metric, one line per run ------------------------------
  const PALETTE = ["#2f55d4", "#d4462f", "#17844a", "#9b3fd0", "#c77800", "#0f8a9d",
                   "#d43f8d", "#5b6474", "#6b8e23", "#8b4513"];

  function compare(team, runs) {
    const container = document.getElementById("compare-charts");
    document.querySelectorAll(".run-legend .swatch").forEach((el) => {
      el.style.background = PALETTE[+el.dataset.index % PALETTE.length];
    });
    const toggle = document.getElementById("show-all-keys");
    const table = document.getElementById("config-table");
    if (toggle && table) toggle.addEventListener("change", () => table.classList.toggle("only-diff", !toggle.checked));
    if (!container) return;
    // One request: the compare endpoint overlays every run's series by metric name.
    const query = runs.map((r) => `run=${encodeURIComponent(r.id)}`).join("&");
    fetch(`/api/v1/teams/${team}/runs/compare?${query}&max_points=300`, { credentials: "same-origin" })
      .then((x) => (x.ok ? x.json() : { metrics: { series: [] } }))
      .then((body) => {
        const byName = new Map(((body.metrics || {}).series || [])
          .filter((s) => !EXPERT.test(s.name) && Object.keys(s.runs || {}).length)
          .map((s) => [s.name, s.runs]));
        container.innerHTML = "";
        if (!byName.size) {
          container.innerHTML = '<p class="empty">None of these runs has reported metrics yet.</p>';
          return;
        }
        [...byName.keys()].sort((a, b) => {
          const ga = GROUPS.findIndex(([, re]) => re.test(a)), gb = GROUPS.findIndex(([, re]) => re.test(b));
          return (ga < 0 ? 99 : ga) - (gb < 0 ? 99 : gb) || a.localeCompare(b);
        }).forEach((name) => {
          const perRun = runs.map((r) => new Map((byName.get(name)[r.id] || []).map((p) => [p.step, p.last])));
          const steps = [...new Set(perRun.flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
          const data = [steps, ...perRun.map((m) => steps.map((st) => (m.has(st) ? m.get(st) : null)))];
          const box = document.createElement("figure");
          box.className = "chart";
          box.dataset.metric = name;
          const cap = document.createElement("figcaption");
          cap.textContent = name;
          box.appendChild(cap);
          container.appendChild(box);
          const width = Math.max(280, Math.floor(box.clientWidth || 420) - 8);
          const plot = new uPlot({
            width, height: 200, scales: { x: { time: false } }, legend: { show: false },
            series: [{ label: "step" }, ...runs.map((r, i) => ({
              label: r.label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))],
            axes: [{ stroke: "#5b6474" }, { stroke: "#5b6474" }],
          }, data, box);
          fit(box, plot);
        });
      });
  }

  window.Crucible = { liveRun, liveRunsTable, compareSelection, compare };
})();
