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

  // --- run page -----------------------------------------------------------------------
  function makeChart(container, name) {
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
    return { box, plot, data, lastStep: -Infinity };
  }

  function liveRun(opts) {
    const charts = new Map();
    const container = document.getElementById("charts");
    const events = document.getElementById("events");
    const statusEl = document.getElementById("run-status");
    let lastSeq = opts.after;

    const chartFor = (name) => {
      if (!charts.has(name)) {
        const empty = document.getElementById("no-metrics");
        if (empty) empty.remove();
        charts.set(name, makeChart(container, name));
      }
      return charts.get(name);
    };
    const redraw = (c) => c.plot.setData(c.data);

    const appendPoints = (names, steps, values) => {
      const touched = new Set();
      for (let i = 0; i < names.length; i++) {
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

  window.Crucible = { liveRun, liveRunsTable };
})();
