// Line charts for the run and compare pages, on uPlot (static/vendor/uplot-*).
//
// Why the axis code is ours and not uPlot's defaults: uPlot picks tick steps from a fixed
// list and formats every label of an axis with the same fixed decimals. A series that sits
// within 1e-7 of 1.0 (an importance ratio) then asks for a near-zero step and the page
// froze; a 1e-8 loss rounded every tick to "0"; 9,892–12,754 tokens/s overflowed the default
// gutter so the leading digit was clipped. Here the y range comes from the data (flat series
// get a padded range), ticks are "nice" steps of that range, labels get exactly the digits
// their step needs (SI prefixes for big values, scientific notation for tiny ones), and the
// gutter is measured from the labels. Hover values, the legend, the synced crosshair and
// the synced zoom are uPlot's own legend, cursor sync and hooks.
(function () {
  "use strict";
  const C = (window.Crucible = window.Crucible || {});

  // --- numbers ---------------------------------------------------------------------------
  const FLAT = 1e-6; // a relative spread below this is float noise: draw the series flat
  // [from magnitude, divisor, prefix]: "k" from 10,000 up (2,500 reads better than 2.5k).
  const SI = [[1e12, 1e12, "T"], [1e9, 1e9, "G"], [1e6, 1e6, "M"], [1e4, 1e3, "k"]];

  /** The y range for values in [min, max]: 5% padding; a flat series gets ±5% of itself. */
  function dataRange(min, max) {
    if (min == null || max == null || !isFinite(min) || !isFinite(max)) return [0, 1];
    const mag = Math.max(Math.abs(min), Math.abs(max));
    const span = max - min;
    if (span <= mag * FLAT) {
      const mid = (min + max) / 2;
      const pad = mag > 0 ? mag * 0.05 : 1;
      return [mid - pad, mid + pad];
    }
    let lo = min - span * 0.05, hi = max + span * 0.05;
    if (min >= 0 && lo < 0) lo = 0;
    if (max <= 0 && hi > 0) hi = 0;
    return [lo, hi];
  }

  /** The same for a log axis (positive values only). */
  function logRange(min, max) {
    if (!(min > 0) || !(max > 0) || !isFinite(min) || !isFinite(max)) return [1, 10];
    if (max / min < 1 + FLAT) return [min / 2, max * 2];
    const f = Math.pow(max / min, 0.05);
    return [min / f, max * f];
  }

  /** 1, 2, 2.5 or 5 times a power of ten, the smallest not below ``raw``. */
  function niceStep(raw) {
    if (!(raw > 0) || !isFinite(raw)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
  }

  /** Ticks at multiples of a nice step inside [lo, hi], about ``target`` of them. */
  function linearTicks(lo, hi, target, minStep) {
    if (!(hi > lo)) return [lo];
    let step = niceStep((hi - lo) / Math.max(1, target));
    if (minStep && step < minStep) step = minStep;
    if (minStep && !Number.isInteger(step)) step = Math.floor(step); // integer axis: 2.5 -> 2
    const first = Math.ceil(lo / step - 1e-9), last = Math.floor(hi / step + 1e-9);
    const out = [];
    for (let k = first; k <= last && out.length < 60; k++) {
      const v = k * step;
      out.push(Math.abs(v) < step * 1e-9 ? 0 : +v.toPrecision(15));
    }
    return out;
  }

  function logTicks(lo, hi, target) {
    const a = Math.ceil(Math.log10(lo) - 1e-9), b = Math.floor(Math.log10(hi) + 1e-9);
    if (b - a < 1) return linearTicks(lo, hi, target);
    const every = Math.max(1, Math.ceil((b - a + 1) / Math.max(2, target)));
    const out = [];
    for (let e = a; e <= b; e += every) out.push(+Math.pow(10, e).toPrecision(15));
    return out;
  }

  const noNegZero = (s) => (/^-0(\.0*)?(e[+-]?\d+)?$/.test(s) ? s.slice(1) : s);

  /** Labels for evenly spaced ticks: the digits the step needs, and more if two adjacent
   * labels would still read the same. */
  function formatTicks(vals) {
    if (!vals.length) return [];
    const mag = Math.max(...vals.map(Math.abs));
    if (mag === 0) return vals.map(() => "0");
    let step = Infinity;
    for (let i = 1; i < vals.length; i++) step = Math.min(step, Math.abs(vals[i] - vals[i - 1]));
    if (!isFinite(step) || step === 0) step = mag;
    const e = Math.floor(Math.log10(step) + 1e-9);
    const extra = Math.abs(step / Math.pow(10, e) - 2.5) < 1e-6 ? 1 : 0;
    let make, digits;
    if (mag >= 1e15 || mag < 1e-3) {
      digits = Math.max(0, Math.floor(Math.log10(mag) + 1e-9) - e + extra);
      make = (d) => (v) => (v === 0 ? "0" : noNegZero(v.toExponential(Math.min(d, 20))));
    } else if (mag >= 1e4) {
      const [, p, s] = SI.find(([q]) => mag >= q);
      digits = Math.max(0, Math.round(Math.log10(p)) - e + extra);
      make = (d) => (v) => (v === 0 ? "0" : noNegZero((v / p).toFixed(Math.min(d, 20))) + s);
    } else {
      digits = Math.max(0, -e + extra);
      make = (d) => (v) => noNegZero(v.toFixed(Math.min(d, 20)));
    }
    for (let d = digits; d <= digits + 12; d++) {
      const out = vals.map(make(d));
      if (out.every((s, i) => i === 0 || s !== out[i - 1])) return out;
    }
    return vals.map(make(digits + 12));
  }

  /** One value for people (legend, tooltip, summaries): 8 significant digits, no float
   * noise, scientific notation for tiny and huge magnitudes. */
  function formatValue(v) {
    if (v == null || Number.isNaN(v)) return "—";
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e9 || a < 1e-4) return noNegZero(v.toExponential(4).replace(/\.?0+e/, "e"));
    return String(+v.toPrecision(8));
  }

  // Durations (relative-time axis): ticks and labels in the unit the span suggests.
  const UNITS = [[86400, "d"], [3600, "h"], [60, "min"], [1, "s"]];
  const unitFor = (span) => (UNITS.find(([u]) => span >= 2 * u) || UNITS[3]);
  function formatDuration(sec) {
    if (sec == null) return "—";
    const [u, name] = unitFor(Math.abs(sec));
    return `${+(sec / u).toPrecision(4)} ${name}`;
  }

  /** Exponential moving average, debiased (TensorBoard's smoothing): the first points are
   * not dragged towards 0. Gaps (null) stay gaps. */
  function ema(values, alpha) {
    if (!(alpha > 0)) return values.slice();
    const out = new Array(values.length);
    let acc = 0, n = 0;
    for (let i = 0; i < values.length; i++) {
      const y = values[i];
      if (y == null) { out[i] = null; continue; }
      acc = acc * alpha + (1 - alpha) * y;
      n++;
      out[i] = acc / (1 - Math.pow(alpha, n));
    }
    return out;
  }

  // Units by metric name (shown in captions, the legend and tooltips).
  const UNIT_RULES = [
    [/tokens_per_s$/, "tokens/s"], [/samples_per_s|items_per_s/, "items/s"],
    [/steps_per_s$/, "steps/s"], [/_per_s$/, "/s"], [/_ms$/, "ms"],
    [/(^|[/_])(latency|duration|elapsed|time|wait|seconds)(_s)?$|_s$/, "s"],
    [/_bytes$/, "bytes"], [/_mb$/, "MB"], [/(_len|_length|tokens)$/, "tokens"],
    [/(_frac|_ratio_frac|_rate|idle|hit_rate.*)$/, "fraction"],
  ];
  const unitOf = (name) => (UNIT_RULES.find(([re]) => re.test(name)) || [null, ""])[1];

  // --- drawing helpers -------------------------------------------------------------------
  const FONT = "12px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
  let measurer = null;
  function textWidth(s) {
    if (!measurer) measurer = document.createElement("canvas").getContext("2d");
    measurer.font = FONT;
    return measurer.measureText(s).width;
  }
  /** Gutter width from the widest label (uPlot calls this again when labels change). */
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    if (cycleNum > 1 && axis._size) return axis._size;
    let w = 0;
    for (const v of values || []) w = Math.max(w, textWidth(String(v)));
    return Math.ceil(w) + 22;
  }
  // Theme colours, read once (getComputedStyle per chart forces a style pass per chart)
  // and again when the system switches between light and dark.
  let theme = null;
  const cssVar = (name, fallback) => {
    if (!theme) theme = getComputedStyle(document.documentElement);
    return (theme.getPropertyValue(name) || "").trim() || fallback;
  };
  if (window.matchMedia) {
    window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => { theme = null; });
  }
  function withAlpha(hex, a) {
    const m = /^#([0-9a-f]{6})$/i.exec(hex);
    if (!m) return hex;
    const n = parseInt(m[1], 16);
    return `rgba(${n >> 16},${(n >> 8) & 255},${n & 255},${a})`;
  }
  function download(filename, blob) {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = filename;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 2000);
  }
  const fileSafe = (s) => s.replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "") || "chart";

  // A floating box with every series' value at the cursor, on the chart under the mouse
  // only (the crosshair and the legends of the other charts follow through the sync).
  function tooltipPlugin(chart) {
    let tip = null, hovering = false;
    return {
      hooks: {
        init: (u) => {
          tip = document.createElement("div");
          tip.className = "chart-tip";
          tip.hidden = true;
          u.over.appendChild(tip);
          u.over.addEventListener("mouseenter", () => { hovering = true; });
          u.over.addEventListener("mouseleave", () => { hovering = false; tip.hidden = true; });
        },
        setCursor: (u) => {
          const i = u.cursor.idx;
          if (!hovering || i == null) { tip.hidden = true; return; }
          tip.replaceChildren();
          const head = document.createElement("div");
          head.className = "tip-x";
          head.textContent = `${u.series[0].label} ${chart.formatX(u.data[0][i])}`;
          tip.appendChild(head);
          let rows = 0;
          u.series.forEach((s, si) => {
            if (si === 0 || !s.show || chart.isRaw(si)) return;
            const v = u.data[si][i];
            if (v == null) return;
            const row = document.createElement("div");
            const sw = document.createElement("span");
            sw.className = "swatch";
            sw.style.background = s._stroke || s.stroke;
            row.appendChild(sw);
            const raw = chart.rawOf(si);
            const rawV = raw != null ? u.data[raw][i] : null;
            row.appendChild(document.createTextNode(` ${s.label}: ${formatValue(v)}`
              + (rawV != null && rawV !== v ? ` (raw ${formatValue(rawV)})` : "")
              + (chart.unit && chart.unit !== "fraction" ? ` ${chart.unit}` : "")));
            tip.appendChild(row);
            rows++;
          });
          if (!rows) { tip.hidden = true; return; }
          tip.hidden = false;
          const left = u.cursor.left, top = u.cursor.top;
          const w = tip.offsetWidth, h = tip.offsetHeight, W = u.over.clientWidth;
          tip.style.left = Math.max(0, left + 12 + w > W ? left - w - 12 : left + 12) + "px";
          tip.style.top = Math.max(0, Math.min(top + 12, u.over.clientHeight - h)) + "px";
        },
      },
    };
  }

  // --- a page's charts ---------------------------------------------------------------------
  // A group shares the page controls (smoothing, log y, x mode), the crosshair and the zoom.
  class ChartGroup {
    constructor(key, state) {
      this.key = key;
      this.state = Object.assign({ smoothing: 0, logY: false, x: "step" }, state || {});
      this.charts = [];
      this.syncingZoom = false;
      this.zoom = null; // the shared x window, or null for each chart's full range
    }
    add(chart) { this.charts.push(chart); chart.group = this; return chart; }
    set(changes) {
      const structural = ("x" in changes && changes.x !== this.state.x)
        || ("logY" in changes && changes.logY !== this.state.logY)
        || ("smoothing" in changes && (changes.smoothing > 0) !== (this.state.smoothing > 0));
      if ("x" in changes && changes.x !== this.state.x) this.zoom = null;
      Object.assign(this.state, changes);
      if (structural) this.charts.forEach((c) => { c.presetWidth = c.body.clientWidth; });
      this.charts.forEach((c) => (structural ? c.rebuild() : c.refresh()));
    }
    zoomTo(source, min, max) {
      if (this.syncingZoom) return;
      this.syncingZoom = true;
      const full = source.fullRange();
      const reset = full && min <= full[0] && max >= full[1];
      this.zoom = reset ? null : [min, max];
      for (const c of this.charts) {
        if (c === source || !c.plot) continue;
        if (reset) { const r = c.fullRange(); if (r) c.plot.setScale("x", { min: r[0], max: r[1] }); }
        else c.plot.setScale("x", { min, max });
      }
      this.syncingZoom = false;
    }
    resetZoom() {
      this.zoom = null;
      this.syncingZoom = true;
      for (const c of this.charts) {
        const r = c.plot && c.fullRange();
        if (r) c.plot.setScale("x", { min: r[0], max: r[1] });
      }
      this.syncingZoom = false;
    }
  }

  /** One figure: a caption (name, unit, last value, CSV/PNG buttons) and a uPlot chart of
   * one or more series. A series is {label, color, steps, walls, values} and grows in
   * place (``append``) for live pages. */
  class Chart {
    constructor(parent, name, series, opts) {
      this.name = name;
      this.series = series;
      this.unit = (opts && opts.unit) || unitOf(name);
      this.height = (opts && opts.height) || 200;
      this.plot = null;
      this.group = null;
      this.layout = null; // uPlot series index -> {kind: "raw"|"smooth", s: series index}
      const box = (this.box = document.createElement("figure"));
      box.className = "chart";
      box.dataset.metric = name;
      const cap = document.createElement("figcaption");
      const title = document.createElement("span");
      title.className = "chart-title";
      title.textContent = name;
      title.title = name;
      cap.appendChild(title);
      if (this.unit) {
        const u = document.createElement("span");
        u.className = "unit muted";
        u.textContent = ` (${this.unit})`;
        cap.appendChild(u);
      }
      this.lastEl = document.createElement("span");
      this.lastEl.className = "last-value";
      cap.appendChild(this.lastEl);
      const tools = document.createElement("span");
      tools.className = "chart-tools";
      for (const [label, fn, hint] of [["CSV", () => this.exportCsv(), "Download this chart's data as CSV"],
        ["PNG", () => this.exportPng(), "Download this chart as a PNG image"]]) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "link small";
        b.textContent = label;
        b.title = hint;
        b.setAttribute("aria-label", `${hint} (${name})`);
        b.addEventListener("click", fn);
        tools.appendChild(b);
      }
      cap.appendChild(tools);
      box.appendChild(cap);
      this.body = document.createElement("div");
      this.body.className = "chart-body";
      box.appendChild(this.body);
      parent.appendChild(box);
    }

    get state() { return this.group ? this.group.state : { smoothing: 0, logY: false, x: "step" }; }
    isRaw(si) { return !!(this.layout && this.layout[si] && this.layout[si].kind === "raw" && this.state.smoothing > 0); }
    rawOf(si) {
      if (!this.layout || !(this.state.smoothing > 0)) return null;
      const me = this.layout[si];
      const found = this.layout.findIndex((l, i) => i > 0 && l && l.kind === "raw" && l.s === me.s);
      return found > 0 ? found : null;
    }
    canLog() { return this.series.every((s) => s.values.every((v) => v == null || v > 0)); }
    logOn() { return this.state.logY && this.canLog(); }

    xsOf(s) {
      const mode = this.state.x;
      if (mode === "step") return s.steps;
      const walls = s.walls && s.walls.length === s.steps.length ? s.walls : s.steps;
      if (mode === "wall") return walls;
      const t0 = walls.length ? walls[0] : 0;
      return walls.map((w) => w - t0);
    }
    formatX(x) {
      if (x == null) return "—";
      if (this.state.x === "wall") return new Date(x * 1000).toLocaleString();
      if (this.state.x === "relative") return formatDuration(x);
      return String(x);
    }
    xLabel() { return { step: "step", wall: "time", relative: "elapsed" }[this.state.x]; }

    /** The aligned uPlot data and the layout of its series. */
    build() {
      const smooth = this.state.smoothing > 0;
      const tables = [], layout = [null];
      this.series.forEach((s, i) => {
        const xs = this.xsOf(s);
        let rising = true;
        for (let k = 1; k < xs.length && rising; k++) rising = xs[k] > xs[k - 1];
        if (rising) { // the usual case (steps in order): use the arrays as they are
          const cols = [xs, s.values];
          layout.push({ kind: "raw", s: i });
          if (smooth) { cols.push(ema(s.values, this.state.smoothing)); layout.push({ kind: "smooth", s: i }); }
          tables.push(cols);
          return;
        }
        let idx = xs.map((_, k) => k);
        if (this.state.x !== "step") idx.sort((a, b) => xs[a] - xs[b]);
        // Equal x values (a resumed step logged twice in wall mode is not possible, but two
        // points at one second are): keep the last one, uPlot needs strictly rising x.
        const x = [], y = [];
        for (const k of idx) {
          if (x.length && xs[k] === x[x.length - 1]) { y[y.length - 1] = s.values[k]; continue; }
          x.push(xs[k]); y.push(s.values[k]);
        }
        const cols = [x, y];
        layout.push({ kind: "raw", s: i });
        if (smooth) { cols.push(ema(y, this.state.smoothing)); layout.push({ kind: "smooth", s: i }); }
        tables.push(cols);
      });
      const data = tables.length === 1 ? tables[0] : window.uPlot.join(tables);
      return { data, layout };
    }

    fullRange() {
      if (!this.plot) return null;
      const xs = this.plot.data[0];
      if (!xs.length) return null;
      return this.singleX(xs[0], xs[xs.length - 1]);
    }
    singleX(min, max) {
      if (min !== max) return [min, max];
      const pad = this.state.x === "step" ? 1 : 60;
      return [min - pad, max + pad];
    }

    options(layout) {
      const smooth = this.state.smoothing > 0;
      const log = this.logOn();
      const muted = cssVar("--muted", "#5b6474"), grid = cssVar("--line", "#dfe3ea");
      const single = this.series.every((s) => s.values.length <= 1);
      const series = [{ label: this.xLabel(), value: (u, v) => this.formatX(v) }];
      layout.slice(1).forEach((l) => {
        const s = this.series[l.s];
        const raw = l.kind === "raw";
        const faint = raw && smooth;
        series.push({
          label: faint ? `${s.label} (raw)` : s.label,
          stroke: faint ? withAlpha(s.color, 0.28) : s.color,
          width: faint ? 1 : 2,
          spanGaps: true,
          value: (u, v) => formatValue(v),
          points: single ? { show: true, size: 8, fill: s.color } : { show: false },
        });
      });
      const plugins = [tooltipPlugin(this)];
      const x = this.state.x;
      const xAxis = { stroke: muted, font: FONT, grid: { stroke: grid, width: 1 },
                      ticks: { stroke: grid, width: 1 } };
      if (x === "step") {
        xAxis.splits = (u, ai, min, max) => linearTicks(min, max, Math.max(2, Math.floor(u.bbox.width / devicePixelRatio / 70)), 1);
        xAxis.values = (u, splits) => formatTicks(splits);
      } else if (x === "relative") {
        xAxis.splits = (u, ai, min, max) => {
          const [unit] = unitFor(max - min);
          return linearTicks(min / unit, max / unit, Math.max(2, Math.floor(u.bbox.width / devicePixelRatio / 70))).map((t) => t * unit);
        };
        xAxis.values = (u, splits) => {
          const [unit, name] = unitFor((u.scales.x.max || 0) - (u.scales.x.min || 0));
          return formatTicks(splits.map((t) => t / unit)).map((s) => `${s}${name === "min" ? "m" : name}`);
        };
      }
      return {
        width: this.width(), height: this.height,
        plugins,
        scales: {
          x: { time: x === "wall", range: (u, min, max) => (min == null ? [0, 1] : this.singleX(min, max)) },
          y: log ? { distr: 3, log: 10, range: (u, min, max) => logRange(min, max) }
                 : { range: (u, min, max) => dataRange(min, max) },
        },
        legend: { show: true, live: true },
        cursor: {
          sync: { key: this.group ? this.group.key : this.name, setSeries: false },
          drag: { x: true, y: false },
          points: { size: 6 },
        },
        series,
        axes: [xAxis, {
          stroke: muted, font: FONT, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 },
          size: axisSize,
          splits: (u, ai, min, max) => (log ? logTicks(min, max, 4)
            : linearTicks(min, max, Math.max(2, Math.round(u.bbox.height / devicePixelRatio / 30)))),
          values: (u, splits) => (log ? splits.map(formatValue) : formatTicks(splits)),
        }],
        hooks: {
          setScale: [(u, key) => {
            if (key === "x" && this.group && !this.building) this.group.zoomTo(this, u.scales.x.min, u.scales.x.max);
          }],
          ready: [(u) => this.hideRawLegend(u)],
        },
      };
    }

    hideRawLegend(u) {
      if (!this.layout) return;
      const rows = u.root.querySelectorAll(".u-legend .u-series");
      this.layout.forEach((l, i) => { if (l && rows[i] && this.isRaw(i)) rows[i].hidden = true; });
    }

    width() {
      // A width measured for a batch of charts at once (see ``buildAll``) saves a forced
      // layout per chart; later rebuilds measure again.
      const w = this.presetWidth || this.body.clientWidth || this.box.clientWidth || 420;
      this.presetWidth = 0;
      return Math.max(240, Math.floor(w));
    }

    rebuild() {
      if (this.plot) { this.plot.destroy(); this.plot = null; }
      const { data, layout } = this.build();
      this.layout = layout;
      this.building = true;
      this.plot = new window.uPlot(this.options(layout), data, this.body);
      this.building = false;
      this.box.__plot = this.plot;
      const z = this.group && this.group.zoom;
      if (z) { this.building = true; this.plot.setScale("x", { min: z[0], max: z[1] }); this.building = false; }
      this.box.classList.toggle("log-y", this.logOn());
      this.box.classList.toggle("no-log", this.state.logY && !this.canLog());
      this.box.title = this.state.logY && !this.canLog() ? "Linear axis: this series has values ≤ 0, which a log axis cannot show." : "";
      this.showLast();
    }

    /** New data, same structure: uPlot keeps the zoom when told not to reset scales. */
    refresh() {
      if (!this.plot) return this.rebuild();
      const { data, layout } = this.build();
      if (layout.length !== this.layout.length) return this.rebuild();
      this.building = true;
      const z = this.group && this.group.zoom;
      this.plot.setData(data, !z);
      if (z) this.plot.setScale("x", { min: z[0], max: z[1] });
      this.building = false;
      this.showLast();
    }

    append(index, steps, walls, values) {
      const s = this.series[index];
      for (let i = 0; i < steps.length; i++) {
        const last = s.steps.length ? s.steps[s.steps.length - 1] : -Infinity;
        if (steps[i] <= last) continue; // already covered by the downsampled load
        s.steps.push(steps[i]); s.walls.push(walls[i]); s.values.push(values[i]);
      }
    }

    showLast() {
      const parts = this.series.filter((s) => s.values.length).map((s) => {
        const v = s.values[s.values.length - 1];
        return this.series.length > 1 ? `${s.label} ${formatValue(v)}` : formatValue(v);
      });
      this.lastEl.textContent = parts.length === 1 ? ` · last ${parts[0]} @ step ${this.series[0].steps[this.series[0].steps.length - 1]}` : "";
      this.box.dataset.points = this.series.reduce((n, s) => n + s.values.length, 0);
    }

    exportCsv() {
      const { data, layout } = this.build();
      const head = [this.state.x === "step" ? "step" : this.state.x === "wall" ? "wall_time" : "elapsed_s"];
      layout.slice(1).forEach((l) => head.push(this.series[l.s].label + (l.kind === "smooth" ? " (smoothed)" : "")));
      const esc = (s) => (/[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s);
      const lines = [head.map(esc).join(",")];
      for (let i = 0; i < data[0].length; i++) {
        lines.push(data.map((col) => (col[i] == null ? "" : String(col[i]))).join(","));
      }
      download(`${fileSafe(this.name)}.csv`, new Blob([lines.join("\n") + "\n"], { type: "text/csv" }));
    }

    exportPng() {
      if (!this.plot) return;
      const src = this.plot.ctx.canvas;
      const ratio = window.devicePixelRatio || 1;
      const titleH = Math.round(24 * ratio);
      const out = document.createElement("canvas");
      out.width = src.width;
      out.height = src.height + titleH;
      const ctx = out.getContext("2d");
      ctx.fillStyle = cssVar("--panel", "#fff");
      ctx.fillRect(0, 0, out.width, out.height);
      ctx.fillStyle = cssVar("--ink", "#1b2130");
      ctx.font = `600 ${Math.round(13 * ratio)}px system-ui, sans-serif`;
      ctx.fillText(this.name + (this.unit ? ` (${this.unit})` : ""), 8 * ratio, 17 * ratio);
      ctx.drawImage(src, 0, titleH);
      out.toBlob((blob) => blob && download(`${fileSafe(this.name)}.png`, blob), "image/png");
    }
  }

  // Charts follow their box's width (window resizes, groups reflowing).
  const resizer = window.ResizeObserver ? new ResizeObserver((entries) => {
    for (const entry of entries) {
      const plot = entry.target.closest(".chart").__plot;
      const width = Math.max(240, Math.floor(entry.contentRect.width));
      if (plot && Math.abs(plot.width - width) > 4) plot.setSize({ width, height: plot.height });
    }
  }) : null;
  function observe(chart) { if (resizer) resizer.observe(chart.body); }

  /** Wire a controls form (smoothing range, log checkbox, x select, reset button) to a
   * group; the choice is remembered per browser. */
  function controls(form, group) {
    if (!form) return;
    const saved = (() => { try { return JSON.parse(localStorage.getItem("crucible.charts") || "{}"); } catch (e) { return {}; } })();
    const smoothing = form.querySelector('[name="smoothing"]');
    const smoothingOut = form.querySelector("output");
    const log = form.querySelector('[name="log_y"]');
    const x = form.querySelector('[name="x"]');
    const reset = form.querySelector('[data-action="reset-zoom"]');
    if (saved.smoothing != null && smoothing) smoothing.value = saved.smoothing;
    if (saved.x && x && [...x.options].some((o) => o.value === saved.x)) x.value = saved.x;
    if (saved.logY != null && log) log.checked = !!saved.logY;
    const read = () => ({
      smoothing: smoothing ? Math.min(0.99, Math.max(0, parseFloat(smoothing.value) || 0)) : 0,
      logY: log ? log.checked : false,
      x: x ? x.value : "step",
    });
    const show = (st) => { if (smoothingOut) smoothingOut.textContent = st.smoothing > 0 ? st.smoothing.toFixed(2) : "off"; };
    let timer = null;
    const apply = () => {
      const st = read();
      show(st);
      try { localStorage.setItem("crucible.charts", JSON.stringify(st)); } catch (e) { /* private mode */ }
      group.set(st);
    };
    form.addEventListener("input", (e) => {
      if (e.target === smoothing) { show(read()); clearTimeout(timer); timer = setTimeout(apply, 60); }
    });
    form.addEventListener("change", apply);
    form.addEventListener("submit", (e) => e.preventDefault());
    if (reset) reset.addEventListener("click", () => group.resetZoom());
    Object.assign(group.state, read());
    show(group.state);
  }

  /** Build many charts: measure every box first (one layout), then draw them all. */
  function buildAll(charts) {
    charts.forEach((c) => { c.presetWidth = c.body.clientWidth; });
    charts.forEach((c) => { c.rebuild(); observe(c); });
  }

  C.charts = { ChartGroup, Chart, controls, observe, buildAll, dataRange, logRange, niceStep, linearTicks,
               logTicks, formatTicks, formatValue, formatDuration, ema, unitOf };
})();
