// Live overview: draws the hub's snapshot, then extends the traces from /ws/live messages.
// Message shapes are those of traind.daemon.hub (snapshot, step, eval, precision, snr, run).
(() => {
  "use strict";

  const root = document.getElementById("overview");
  if (!root || !window.Plotly || !window.traindCharts) return;

  // Enough history to see a trend without making every extendTraces redraw slow.
  const MAX_POINTS = Number(root.dataset.maxPoints || 5000);
  // Messages are buffered and drawn together: one redraw per chart per flush, however fast
  // the trainer steps.
  const FLUSH_MS = 250;
  const BACKOFF_MIN_MS = 500;
  const BACKOFF_MAX_MS = 10000;

  const COLORS = { loss: "#2457c5", val: "#e8590c", tps: "#0f8a5f", grad: "#7048e8" };
  const { CONFIG } = window.traindCharts;

  const charts = {
    loss: document.getElementById("chart-loss"),
    tps: document.getElementById("chart-tps"),
    grad: document.getElementById("chart-gradnorm"),
  };
  const fields = {};
  for (const el of root.querySelectorAll("[data-field]")) fields[el.dataset.field] = el;
  const conn = document.getElementById("conn");
  const precisionSection = document.getElementById("precision");
  const precCharts = {
    timeline: document.getElementById("chart-precision"),
    snr: document.getElementById("chart-snr"),
  };

  let run = root.dataset.run === "" ? null : Number(root.dataset.run);
  let lastStep = null;
  let lastEvalStep = null;
  let pending = { steps: [], evals: [] };
  let flushTimer = null;
  // Adaptive precision: the switches and the per-window SNRs of this run, in arrival order.
  let prec = { switches: [], windows: [], dirty: false };

  // ---- formatting (matches traind.web.views on the server) ----
  const fmtNum = (v) => (typeof v === "number" && isFinite(v) ? v.toFixed(4) : "–");
  // as web/views.fmt_percent: whole percents from 10%, one decimal below
  const fmtPct = (v) => (typeof v === "number" && isFinite(v)
    ? (v * 100 >= 10 ? `${(v * 100).toFixed(0)}%` : `${(v * 100).toFixed(1)}%`) : "–");
  const fmtCount = (v) =>
    typeof v === "number" && isFinite(v) ? Math.round(v).toLocaleString("en-US") : "–";
  // Same buckets as views.fmt_duration: 42s, 3m 07s, 2h 05m, 3d 4h.
  const pad = (n) => String(n).padStart(2, "0");
  function fmtDuration(seconds) {
    if (!(seconds >= 0)) return "–";
    const s = Math.floor(seconds);
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
    return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }
  const setField = (name, text) => {
    if (fields[name]) fields[name].textContent = text;
  };

  // ---- charts ----
  // Keeps the user's zoom while points stream in; a new run gets a fresh view.
  // (A new x axis is a new view too: its old range would mean nothing on it.)
  const layout = (yTitle, showLegend) => window.traindCharts.layout(
    yTitle, showLegend, `${run}:${tools.x ? tools.x.value : "step"}`);
  const line = window.traindCharts.line;

  // ---- the chart tools (charts.js): smoothing, x axis, log y, linked zoom ----
  const tools = {
    smoothing: document.getElementById("smoothing"),
    smoothingValue: document.getElementById("smoothing-value"),
    x: document.getElementById("x-axis"),
    logY: document.getElementById("log-y"),
  };
  const alpha = () => (tools.smoothing ? Number(tools.smoothing.value) : 0);
  const xMode = () => (tools.x ? tools.x.value : "step");
  // Streaming appends raw points by step (extendTraces); any other view is drawn whole.
  const plain = () => alpha() === 0 && xMode() === "step";
  // What the charts show, bounded as the traces are: the redraws' source.
  let shown = { steps: [], evals: [] };

  function chartLayout(yTitle, showLegend) {
    const l = layout(yTitle, showLegend);
    l.xaxis = { ...l.xaxis, title: { text: window.traindCharts.X_TITLE[xMode()] },
      type: xMode() === "wall" ? "date" : "linear" };
    if (tools.logY && tools.logY.checked) l.yaxis = { ...l.yaxis, type: "log" };
    return l;
  }

  // A figure's line (smoothed, with its raw line kept faint under it when smoothing).
  function figure(name, color, points, key, t0) {
    const { ema, xValues } = window.traindCharts;
    const x = xValues(xMode(), points.map((m) => m.step), points.map((m) => m.time), t0);
    const y = points.map((m) => m[key]);
    if (!alpha()) return [{ ...line(name, color), x, y }];
    return [
      { ...line(`${name} (raw)`, color), x, y, opacity: 0.25, showlegend: false,
        hoverinfo: "skip" },
      { ...line(name, color), x, y: ema(y, alpha()) },
    ];
  }

  function draw(steps, evals) {
    shown = { steps: steps.slice(-MAX_POINTS), evals: evals.slice(-MAX_POINTS) };
    const { xValues } = window.traindCharts;
    const ev = shown.evals;
    // An evaluation without its own time (a stored one) sits at the time of the first shown
    // step at or after it (one pass: both are in step order).
    let i = 0;
    const st = shown.steps;
    const evTimes = ev.map((m) => {
      while (i < st.length - 1 && st[i].step < m.step) i += 1;
      return m.time || (st.length ? st[i].time : null);
    });
    const t0 = (st.find((m) => m.time) || ev.find((m) => m.time) || {}).time;
    Plotly.react(charts.loss, [
      // Train loss first (trace 0), then val loss: the streaming path extends them by index,
      // and only draws plain lines (one trace each).
      ...figure("train loss", COLORS.loss, shown.steps, "loss", t0),
      {
        ...line("val loss", COLORS.val, { mode: "lines+markers", marker: { size: 6 } }),
        x: xValues(xMode(), ev.map((m) => m.step), evTimes, t0),
        y: ev.map((m) => m.val_loss),
      },
    ], chartLayout("loss", true), CONFIG);
    Plotly.react(charts.tps, figure("tokens/s", COLORS.tps, st, "tokens_per_second", t0),
      chartLayout("tokens/s", false), CONFIG);
    Plotly.react(charts.grad, figure("grad norm", COLORS.grad, st, "grad_norm", t0),
      chartLayout("grad norm", false), CONFIG);
  }
  const redraw = () => draw(shown.steps, shown.evals);

  function extend(div, traces, xs, ys) {
    Plotly.extendTraces(div, { x: xs, y: ys }, traces, MAX_POINTS);
  }

  function flush() {
    flushTimer = null;
    const { steps, evals } = pending;
    pending = { steps: [], evals: [] };
    if (!plain() && (steps.length || evals.length)) {
      draw([...shown.steps, ...steps], [...shown.evals, ...evals]);
    } else {
      shown = { steps: [...shown.steps, ...steps].slice(-MAX_POINTS),
        evals: [...shown.evals, ...evals].slice(-MAX_POINTS) };
      if (steps.length) {
        const xs = steps.map((m) => m.step);
        extend(charts.loss, [0], [xs], [steps.map((m) => m.loss)]);
        extend(charts.tps, [0], [xs], [steps.map((m) => m.tokens_per_second)]);
        extend(charts.grad, [0], [xs], [steps.map((m) => m.grad_norm)]);
      }
      if (evals.length) {
        extend(charts.loss, [1], [evals.map((m) => m.step)], [evals.map((m) => m.val_loss)]);
      }
    }
    // The timeline's last spans grow with the steps; a few bars, redrawn whole.
    if (prec.dirty || (steps.length && !precisionSection.hidden)) drawPrecision();
  }

  // ---- adaptive precision: switch timeline and per-window SNR ----
  function drawPrecision() {
    prec.dirty = false;
    if (!prec.switches.length && !prec.windows.length) {
      precisionSection.hidden = true;
      return;
    }
    precisionSection.hidden = false;
    const last = (xs) => (xs.length ? xs[xs.length - 1].step : 0);
    const end = Math.max(lastStep ?? 0, last(prec.windows), last(prec.switches));
    const groups = window.traindCharts.drawPrecision(
      precCharts.timeline, prec.switches, prec.windows, end, run);
    const xs = prec.windows.map((w) => w.step);
    const lines = groups.map((g) => ({
      ...line(g), x: xs,
      y: prec.windows.map((w) => {
        const i = w.groups.indexOf(g);
        return i < 0 ? null : w.snr[i];
      }),
    }));
    const snrLayout = layout("SNR", true);
    snrLayout.yaxis = { ...snrLayout.yaxis, type: "log" };
    Plotly.react(precCharts.snr, lines, snrLayout, CONFIG);
  }

  function schedule() {
    if (flushTimer === null) flushTimer = setTimeout(flush, FLUSH_MS);
  }

  // ---- header ----
  function showStep(m) {
    setField("step", fmtCount(m.step));
    setField("loss", fmtNum(m.loss));
    setField("tokens_per_second", fmtCount(m.tokens_per_second));
    setField("grad_norm", fmtNum(m.grad_norm));
    if (m.goodput != null) setField("goodput", fmtPct(m.goodput));
    if (m.ettr != null) setField("ettr", fmtPct(m.ettr));
  }

  function showState(state) {
    const el = fields.state;
    if (el) {
      el.textContent = state;
      el.className = `badge badge-${state}`;
    }
    // A run that has ended stops the clock where it is (the exact end is on the runs page).
    const d = fields.duration;
    if (d && state !== "running" && state !== "queued" && !d.dataset.finished) {
      d.dataset.finished = new Date().toISOString();
    }
  }

  // The duration of a running run counts up in the page, not only at render time.
  function tickDuration() {
    const d = fields.duration;
    if (!d || !d.dataset.started) return;
    const end = d.dataset.finished ? Date.parse(d.dataset.finished) : Date.now();
    d.textContent = fmtDuration((end - Date.parse(d.dataset.started)) / 1000);
  }

  // Name and state live in the database, not in live messages: ask the API when the run changes.
  async function refreshRunMeta(id) {
    try {
      const resp = await fetch("/api/runs");
      if (!resp.ok) return;
      const found = (await resp.json()).find((r) => r.id === id);
      if (found && id === run) {
        setField("name", found.name);
        if (fields.duration) {
          fields.duration.dataset.started = found.started_at || "";
          fields.duration.dataset.finished = found.finished_at || "";
        }
        showState(found.state);
      }
    } catch (_) {
      // The header keeps the id; the next run change tries again.
    }
  }

  function switchRun(id) {
    run = id;
    root.dataset.run = String(id);
    lastStep = lastEvalStep = null;
    pending = { steps: [], evals: [] };
    prec = { switches: [], windows: [], dirty: false };
    precisionSection.hidden = true;
    setField("name", `run ${id}`);
    setField("id", `#${id}`);
    for (const f of ["step", "loss", "val_loss", "tokens_per_second", "grad_norm", "duration"]) {
      setField(f, "–");
    }
    if (fields.duration) fields.duration.dataset.started = fields.duration.dataset.finished = "";
    refreshRunMeta(id);
  }

  // ---- the run's history: what the daemon stored, beyond the hub's buffer ----
  // The hub keeps the last few thousand points in memory; a reload (or a daemon restart)
  // would show only those. The stored series (/api/runs/{id}/series, downsampled) are drawn
  // first, and the snapshot's points take over where its buffer begins.
  let history = { steps: [], evals: [] };

  async function loadHistory() {
    if (run === null) return;
    try {
      const resp = await fetch(`/api/runs/${run}/series?points=${MAX_POINTS}`);
      if (!resp.ok) return;
      const d = await resp.json();
      history = {
        steps: d.step.map((step, i) => ({ step, time: d.time[i], loss: d.loss.y[i],
          tokens_per_second: d.tokens_per_second.y[i], grad_norm: d.grad_norm.y[i] })),
        evals: d.evals.step.map((step, i) => ({ step, val_loss: d.evals.val_loss[i],
          time: (d.evals.time || [])[i] })),
      };
    } catch (_) {
      // the live buffer alone, as before
    }
  }

  // History before the buffer's first step, the buffer from there on (one cut for the steps
  // and the evaluations, so neither shows history the other's buffer has replaced).
  function cut(m) {
    const firsts = [m.steps, m.evals].filter((xs) => xs && xs.length).map((xs) => xs[0].step);
    return firsts.length ? Math.min(...firsts) : Infinity;
  }
  const withHistory = (points, key, first) =>
    [...history[key].filter((p) => p.step < first), ...points];

  // ---- messages ----
  function onSnapshot(m) {
    if (m.run === null || (run !== null && m.run !== run)) return; // nothing of this run yet
    snapshotSeen = true;
    if (m.run !== run) switchRun(m.run);
    pending = { steps: [], evals: [] };
    const first = cut(m);
    const steps = withHistory(m.steps || [], "steps", first);
    const evals = withHistory(m.evals || [], "evals", first);
    draw(steps.slice(-MAX_POINTS), evals.slice(-MAX_POINTS));
    lastStep = steps.length ? steps[steps.length - 1].step : null;
    lastEvalStep = evals.length ? evals[evals.length - 1].step : null;
    if (steps.length) showStep(steps[steps.length - 1]);
    if (evals.length) setField("val_loss", fmtNum(evals[evals.length - 1].val_loss));
    prec = { switches: m.precision || [], windows: m.snr || [], dirty: false };
    drawPrecision();
  }

  // The page follows one run (the server's choice, or the picker's): another run's messages
  // never switch or wipe it. A page that opened before any run adopts the first to report.
  function mine(m) {
    if (run === null && m.run !== null && m.run !== undefined) {
      switchRun(m.run);
      draw([], []);
    }
    return m.run === run;
  }

  function onPrecision(m) {
    if (!mine(m)) return;
    (m.type === "precision" ? prec.switches : prec.windows).push(m);
    prec.dirty = true;
    schedule();
  }

  function onPoint(m) {
    if (!mine(m)) return;
    if (m.type === "step") {
      if (m.step === lastStep) return; // a repeat, e.g. overlapping a snapshot
      lastStep = m.step;
      pending.steps.push(m);
      showStep(m);
    } else {
      if (m.step === lastEvalStep) return;
      lastEvalStep = m.step;
      pending.evals.push(m);
      setField("val_loss", fmtNum(m.val_loss));
    }
    schedule();
  }

  function onMessage(m) {
    switch (m.type) {
      case "snapshot": return onSnapshot(m);
      case "step":
      case "eval": return onPoint(m);
      case "precision":
      case "snr": return onPrecision(m);
      case "run": if (m.run === run) showState(m.state); return;
      default: return; // newer daemons may send more kinds; ignore them
    }
  }

  // ---- socket with reconnect ----
  let attempt = 0;
  function setConn(status, text) {
    conn.dataset.status = status;
    conn.textContent = text;
  }

  let snapshotSeen = false;
  function showHistoryAlone() {
    if (!snapshotSeen && run !== null && (history.steps.length || history.evals.length)) {
      onSnapshot({ type: "snapshot", run, steps: [], evals: [] });
    }
  }

  // Returns whether a socket was opened (a page without a live token gets none).
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    // The page's live token: the websocket refuses a handshake without a credential.
    const live = document.querySelector('meta[name="traind-live"]')?.content ?? "";
    if (!live) {  // only a session's pages carry one: a reader without it gets no live feed
      setConn("offline", "log in for live updates");
      return false;
    }
    // The snapshot is of the run this page follows (none yet: the newest run's).
    const follow = run === null ? "" : `&run=${run}`;
    const ws = new WebSocket(
      `${proto}://${location.host}/ws/live?live=${encodeURIComponent(live)}${follow}`);
    ws.onopen = () => {
      attempt = 0;
      setConn("live", "live");
    };
    ws.onmessage = (ev) => onMessage(JSON.parse(ev.data));
    ws.onclose = () => {
      showHistoryAlone();
      // Exponential backoff with jitter, so a restarted daemon is not hit by every tab at once.
      const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** attempt) * (0.75 + Math.random() / 2);
      attempt += 1;
      setConn("reconnecting", `reconnecting in ${Math.ceil(delay / 1000)}s`);
      setTimeout(connect, delay);
    };
    // onerror is always followed by onclose, which does the work.
    return true;
  }

  // The picker (several runs training) follows another run: the page is rendered for it.
  const picker = document.getElementById("run-picker");
  if (picker) {
    picker.addEventListener("change", () => {
      location.search = `?run=${encodeURIComponent(picker.value)}`;
    });
  }

  if (tools.smoothing) {
    tools.smoothing.addEventListener("input", () => {
      tools.smoothingValue.textContent = tools.smoothing.value;
      redraw();
    });
    tools.x.addEventListener("change", redraw);
    tools.logY.addEventListener("change", redraw);
  }

  draw([], []);
  window.traindCharts.linkZoom([charts.loss, charts.tps, charts.grad]);
  loadHistory().then(() => {
    // Drawn with the socket's snapshot, once (two draws racing could leave the older one);
    // alone when no snapshot comes (no live feed, or the socket closes first).
    if (!connect()) showHistoryAlone();
  });
  setInterval(tickDuration, 1000);
})();
