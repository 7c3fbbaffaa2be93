// A run's page, and the comparison of several: draws the series the daemon stored
// (/api/runs/{id}/series: each point the mean of a bucket of steps with its min and max), with
// the chart tools (smoothing, x axis, log y, zoom linked across the charts). One run gets its
// min-max band, heat maps and precision timeline; several are overlaid, a colour each. While a
// run trains, each poll fetches only what came since the last step drawn (?after=) and appends
// it; the whole downsampled series is fetched again once the appended tail passes the points
// budget (or on reload). A run of several ranks may draw a line per rank (loss, tokens/s, step
// time and data wait), lists each rank's medians, its straggler marked, and draws its
// communication per op (latency percentiles, bus bandwidth, bytes raw and sent).
(() => {
  "use strict";

  const root = document.getElementById("run");
  if (!root || !window.Plotly || !window.traindCharts) return;
  const { CONFIG, layout, line } = window.traindCharts;

  const RUNS = (root.dataset.runs || root.dataset.run).split(",").map(Number);
  const RUN = RUNS[0];
  const SINGLE = RUNS.length === 1;
  const NAMES = JSON.parse(root.dataset.names || "{}");  // run id -> its label in the legend
  // One colour per run when several are overlaid: the page's (runviews.PALETTE), so its
  // table's chips and the lines agree.
  const PALETTE = (root.dataset.colors || "#4e79a7").split(",");
  const POINTS = 2000;
  const RANKED = SINGLE && Number(root.dataset.ranks || 1) > 1;
  const RANK_LINES = {  // chart -> the per-rank figures it draws instead of the job's
    "chart-loss": [["loss", "loss", "solid"]],
    "chart-tps": [["tokens_per_second", "tokens/s", "solid"]],
    "chart-step": [["step_seconds", "step", "solid"], ["data_seconds", "data wait", "dot"]],
  };
  const RANK_TABLE = ["step_seconds", "data_seconds", "forward_seconds", "backward_seconds",
    "optimizer_seconds", "tokens_per_second", "loss"];
  const REFRESH_MS = window.traindRefreshMs || 5000;  // a test may poll faster
  const COMM_COLORS = ["#1c7ed6", "#e8590c", "#2b8a3e", "#ae3ec9", "#f08c00"];
  const COLORS = { loss: "#2457c5", val: "#e8590c", tps: "#0f8a5f", grad: "#7048e8",
    lr: "#c2255c", step: "#1c7ed6", data: "#f08c00" };
  const LINES = {  // chart -> the figures it draws (the first gets the band)
    "chart-loss": [["loss", "train loss", COLORS.loss]],
    "chart-tps": [["tokens_per_second", "tokens/s", COLORS.tps]],
    "chart-gradnorm": [["grad_norm", "grad norm", COLORS.grad]],
    "chart-lr": [["lr", "learning rate", COLORS.lr]],
    "chart-step": [["step_seconds", "step", COLORS.step], ["data_seconds", "data wait", COLORS.data]],
  };
  const Y_TITLES = { "chart-loss": "loss", "chart-tps": "tokens/s", "chart-gradnorm": "grad norm",
    "chart-lr": "lr", "chart-step": "seconds" };

  const tools = {
    smoothing: document.getElementById("smoothing"),
    smoothingValue: document.getElementById("smoothing-value"),
    x: document.getElementById("x-axis"),
    logY: document.getElementById("log-y"),
    note: document.getElementById("series-note"),
    perRank: document.getElementById("per-rank"),
  };
  let data = null;  // the first run's series
  let all = {};  // run id -> its series
  let state = root.dataset.state;
  let tail = 0;  // steps appended since the last whole fetch

  // ---- transforms (charts.js: the EMA, the x axis, their titles) ----
  const { ema, X_TITLE } = window.traindCharts;
  const xs = (d) => window.traindCharts.xValues(tools.x.value, d.step, d.time);

  // Evaluations sit at their step; on a time axis, at the time of the nearest stored step.
  function evalXs(d) {
    if (tools.x.value === "step") return d.evals.step;
    const all = xs(d);
    return d.evals.step.map((s) => {
      let i = d.step.findIndex((v) => v >= s);
      if (i < 0) i = d.step.length - 1;
      return all[i];
    });
  }

  // Steps (ascending) on the chosen x axis: on a time axis, the time of the first stored step
  // at or after each (one pass: both lists are in step order).
  function stepXs(d, steps) {
    if (tools.x.value === "step") return steps;
    const all = xs(d);
    let i = 0;
    return steps.map((s) => {
      while (i < d.step.length - 1 && d.step[i] < s) i += 1;
      return all[i];
    });
  }

  function rankTraces(d, id, alpha) {
    const traces = [];
    for (const r of d.ranks.lines) {
      const color = PALETTE[r.rank % PALETTE.length];
      const x = stepXs(d, r.step);
      for (const [key, name, dash] of RANK_LINES[id]) {
        traces.push({ ...line(`rank ${r.rank} ${name}`, color), x, y: ema(r[key], alpha),
          line: { color, width: 1.5, dash } });
      }
    }
    return traces;
  }

  function perRank() {
    return RANKED && tools.perRank && tools.perRank.checked && data && data.ranks
      && data.ranks.lines.length > 1;
  }

  function drawRankTable(d) {
    const card = document.getElementById("ranks-card");
    if (!card) return;
    const rows = (d.ranks && d.ranks.table) || [];
    card.hidden = rows.length < 2;
    const body = card.querySelector("tbody");
    body.replaceChildren(...rows.map((row) => {
      const tr = document.createElement("tr");
      tr.id = `rank-${row.rank}`;
      const cells = [String(row.rank), ...RANK_TABLE.map((k) => {
        const v = row[k];
        if (typeof v !== "number" || !isFinite(v)) return "–";
        return k === "tokens_per_second" ? Math.round(v).toLocaleString("en-US") : v.toFixed(4);
      })];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.className = "num";
        td.textContent = text;
        if (i > 0 && row.slow.includes(RANK_TABLE[i - 1])) {
          td.classList.add("straggler");
          td.title = `rank ${row.rank} is the slowest in this phase`;
        }
        tr.append(td);
      });
      return tr;
    }));
  }

  // ---- drawing ----
  function chartLayout(id, legend) {
    const lay = layout(Y_TITLES[id] || "", legend, `${RUN}-${tools.x.value}`);
    lay.xaxis = { ...lay.xaxis, title: { text: X_TITLE[tools.x.value] },
      type: tools.x.value === "wall" ? "date" : "linear" };
    if (tools.logY.checked) lay.yaxis = { ...lay.yaxis, type: "log" };
    return lay;
  }

  function figureTraces(d, key, name, color, alpha, band) {
    const x = xs(d);
    const f = d[key];
    const traces = [];
    if (band) {  // the bucket's min..max: a spike the mean would hide stays in sight
      traces.push({ type: "scatter", mode: "lines", x, y: f.hi, line: { width: 0 },
        hoverinfo: "skip", showlegend: false, name: `${name} max` });
      traces.push({ type: "scatter", mode: "lines", x, y: f.lo, line: { width: 0 },
        fill: "tonexty", fillcolor: `${color}22`, hoverinfo: "skip", showlegend: false,
        name: `${name} min` });
    }
    if (alpha) {  // raw kept faint under the smoothed line
      traces.push({ ...line(`${name} (raw)`, color), x, y: f.y, opacity: 0.3,
        showlegend: false, hoverinfo: "skip" });
    }
    traces.push({ ...line(name, color), x, y: ema(f.y, alpha) });
    return traces;
  }

  function drawLines() {
    const alpha = Number(tools.smoothing.value);
    for (const [id, figures] of Object.entries(LINES)) {
      const traces = [];
      const ranked = perRank() && id in RANK_LINES;
      if (ranked) {
        traces.push(...rankTraces(data, id, alpha));
        if (id === "chart-loss" && data.evals.step.length) {
          traces.push({ ...line("val loss", COLORS.val, { mode: "lines+markers", marker: { size: 6 } }),
            x: evalXs(data), y: data.evals.val_loss });
        }
      } else if (SINGLE) {
        const d = data;
        figures.forEach(([key, name, color], k) => {
          traces.push(...figureTraces(d, key, name, color, alpha, k === 0));
        });
        if (id === "chart-loss" && d.evals.step.length) {
          traces.push({ ...line("val loss", COLORS.val, { mode: "lines+markers", marker: { size: 6 } }),
            x: evalXs(d), y: d.evals.val_loss });
        }
      } else {
        RUNS.forEach((run, i) => {
          const d = all[run];
          if (!d) return;
          const color = PALETTE[i % PALETTE.length];
          const label = NAMES[run] || `#${run}`;
          const [key] = figures[0];
          traces.push(...figureTraces(d, key, label, color, alpha, false));
          if (id === "chart-loss" && d.evals.step.length) {
            traces.push({ ...line(`${label} val`, color, { mode: "markers",
              marker: { size: 7, symbol: "diamond" } }), x: evalXs(d), y: d.evals.val_loss });
          }
        });
      }
      Plotly.react(document.getElementById(id), traces,
        chartLayout(id, !SINGLE || ranked || id === "chart-loss" || figures.length > 1), CONFIG);
    }
  }

  function drawHeat(cardId, divId, m, key, title) {
    const card = document.getElementById(cardId);
    if (!m.layers.length) { card.hidden = true; return; }
    card.hidden = false;
    // Log colour: norms span decades across layers; a missing value stays blank.
    const z = m[key].map((row) => row.map((v) => (v && v > 0 ? Math.log10(v) : null)));
    const lay = layout("", false, RUN);
    lay.yaxis = { ...lay.yaxis, type: "category", automargin: true, autorange: "reversed" };
    lay.margin = { ...lay.margin, l: 90 };
    lay.hovermode = "closest";
    Plotly.react(document.getElementById(divId), [{
      type: "heatmap", x: m.step, y: m.layers, z, colorscale: "Viridis",
      colorbar: { title: { text: `log10 ${title}` }, thickness: 12 },
      hovertemplate: `%{y} at step %{x}: 10^%{z:.2f}<extra></extra>`,
    }], lay, CONFIG);
  }

  function drawPrecision(d) {
    const card = document.getElementById("precision-card");
    if (!d.precision.length) { card.hidden = true; return; }
    card.hidden = false;
    const end = d.step.length ? d.step[d.step.length - 1] : 0;
    window.traindCharts.drawPrecision(document.getElementById("chart-precision"),
      d.precision, [], end, RUN);
  }

  function showFields(d) {
    const n = d.step.length;
    if (!n) return;
    const set = (name, text) => {
      const el = root.querySelector(`[data-field="${name}"]`);
      if (el) el.textContent = text;
    };
    const num = (v) => (typeof v === "number" && isFinite(v) ? v.toFixed(4) : "–");
    const count = (v) => (typeof v === "number" && isFinite(v)
      ? Math.round(v).toLocaleString("en-US") : "–");
    set("step", count(d.step[n - 1]));
    set("loss", num(d.loss.y[n - 1]));
    set("tokens_per_second", count(d.tokens_per_second.y[n - 1]));
    const v = d.evals.val_loss;
    if (v.length) set("val_loss", num(v[v.length - 1]));
  }

  function commChart(id, traces, yTitle) {
    const lay = layout(yTitle, true, `${RUN}-${tools.x.value}`);
    lay.xaxis = { ...lay.xaxis, title: { text: X_TITLE[tools.x.value] },
      type: tools.x.value === "wall" ? "date" : "linear" };
    Plotly.react(document.getElementById(id), traces, lay, CONFIG);
  }

  function drawComm(d) {
    const charts = document.getElementById("comm-charts");
    if (!charts || !d.comm) return;
    const c = d.comm;
    const note = document.getElementById("comm-note");
    if (!c.ops.length) {
      charts.hidden = true;
      note.textContent = "no collectives stored yet";
      return;
    }
    charts.hidden = false;
    note.textContent = `per collective op, every rank summed: ${c.ops.map((o) => o.op).join(", ")}`;
    const scaled = (ys, k) => ys.map((v) => (v === null ? null : v * k));
    const lat = [];
    const bw = [];
    c.ops.forEach((o, i) => {
      const color = COMM_COLORS[i % COMM_COLORS.length];
      const x = stepXs(d, o.step);
      [["p50", "solid"], ["p95", "dash"], ["p99", "dot"]].forEach(([q, dash]) => {
        lat.push({ ...line(`${o.op} ${q}`, color), x, y: scaled(o[q], 1e3),
          line: { color, width: 1.5, dash } });
      });
      bw.push({ ...line(o.op, color), x, y: scaled(o.bus_bandwidth, 1e-9) });
    });
    commChart("chart-comm-latency", lat, "latency (ms)");
    commChart("chart-comm-busbw", bw, "bus bandwidth (GB/s)");
    const bx = stepXs(d, c.bytes.step);
    commChart("chart-comm-bytes", [
      { ...line("raw", COLORS.grad), x: bx, y: scaled(c.bytes.raw, 1e-6) },
      { ...line("sent", COLORS.tps), x: bx, y: scaled(c.bytes.sent, 1e-6),
        customdata: c.bytes.ratio, hovertemplate: "%{y:.3f} MB sent (%{customdata:.1f}x)<extra></extra>" },
    ], "MB per rank and step");
  }

  function drawAll() {
    if (!data) return;
    drawLines();
    if (!SINGLE) {
      tools.note.textContent = RUNS.map((r) => `${NAMES[r] || "#" + r}: ${
        all[r] ? all[r].points.toLocaleString("en-US") : "?"} steps`).join(" · ");
      return;
    }
    drawHeat("layers-card", "chart-layer-grad", data.layers, "grad_norm", "grad norm");
    drawHeat("updates-card", "chart-layer-update", data.layers, "update_ratio", "update ratio");
    drawPrecision(data);
    if (RANKED) {
      drawRankTable(data);
      drawComm(data);
    }
    const per = data.points > data.step.length
      ? `, each point the mean of ${Math.round(data.points / data.step.length)} steps with their min–max band`
      : "";
    tools.note.textContent = data.points
      ? `${data.points.toLocaleString("en-US")} steps stored${per}`
      : "no steps stored yet";
  }

  // ---- data ----
  function query() {
    // The rank table shows whatever the toggle says; a multi-rank run has collectives.
    return `points=${POINTS}${RANKED ? "&ranks=true&comm=true" : ""}`;
  }

  async function load() {
    try {
      const got = await Promise.all(RUNS.map(async (run) => {
        const resp = await fetch(`/api/runs/${run}/series?${query()}`);
        if (!resp.ok) throw new Error(`run ${run}: HTTP ${resp.status}`);
        return [run, await resp.json()];
      }));
      all = Object.fromEntries(got);
      data = all[RUN];
      tail = 0;
      shown();
    } catch (err) {
      tools.note.textContent = `could not load the stored steps (${err.message})`;
    }
  }

  function shown() {
    drawAll();
    if (SINGLE) showFields(data);
    root.dataset.points = RUNS.map((r) => all[r].points).join(",");
  }

  // Columns ``keys`` of ``own`` (by ascending ``own.step``) cut back to before step ``from``,
  // then ``got``'s appended: a tail's reports replace what the page held from that step on.
  function splice(own, got, keys, from) {
    let cut = own.step.length;
    while (cut > 0 && own.step[cut - 1] >= from) cut -= 1;
    for (const k of keys) {
      own[k].length = cut;
      own[k].push(...got[k]);
    }
  }

  const STEP_FIGURES = Object.values(LINES).flat().map(([key]) => key);
  const COMM_KEYS = ["step", "calls", "bytes_per_second", "bus_bandwidth", "mean", "p50", "p95", "p99"];

  // Appends a tail (?after=) to the drawn series; false when the whole must be fetched again
  // (the layer layout or the ranks changed: a tail cannot say what to redraw).
  function append(d, t) {
    const after = t.after;
    d.step.push(...t.step);
    d.time.push(...t.time);
    for (const k of new Set(STEP_FIGURES)) {  // one step a point: its min and max are itself
      d[k].y.push(...t[k].y);
      d[k].lo.push(...t[k].y);
      d[k].hi.push(...t[k].y);
    }
    d.points += t.points;
    splice(d.evals, t.evals, ["step", "val_loss"], after);
    d.precision = d.precision.filter((p) => p.step < after).concat(t.precision);
    if (t.layers.layers.length) {
      if (t.layers.layers.join() !== d.layers.layers.join()) return false;
      let cut = d.layers.step.length;
      while (cut > 0 && d.layers.step[cut - 1] >= after) cut -= 1;
      d.layers.step.length = cut;
      d.layers.step.push(...t.layers.step);
      for (const k of ["grad_norm", "update_ratio"]) {
        d.layers[k].forEach((row, j) => { row.length = cut; row.push(...t.layers[k][j]); });
      }
    }
    if (t.ranks && d.ranks) {
      for (const line of t.ranks.lines) {
        const own = d.ranks.lines.find((l) => l.rank === line.rank);
        if (!own) return false;
        splice(own, line, ["step", ...Object.keys(line).filter((k) => !["rank", "points", "step"].includes(k))], after);
        own.points += line.points;
      }
    }
    if (t.comm && d.comm) {
      for (const op of t.comm.ops) {
        const own = d.comm.ops.find((o) => o.op === op.op);
        if (own) splice(own, op, COMM_KEYS, after);
        else d.comm.ops.push(op);
      }
      splice(d.comm.bytes, t.comm.bytes, ["step", "raw", "sent", "ratio"], after);
    }
    return true;
  }

  // A poll of a training run: what came after the last step drawn, or the whole series again
  // when there is none yet, when the tail says it left steps out, or when the appended tail
  // has passed the points budget (the chart would outgrow what it draws well).
  async function refresh() {
    if (!data || !data.step.length || tail >= POINTS) return load();
    const after = data.step[data.step.length - 1];
    try {
      const resp = await fetch(`/api/runs/${RUN}/series?${query()}&after=${after}`);
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const t = await resp.json();
      if (t.more || !append(data, t)) return load();
      tail += t.points;
      if (t.points || t.evals.step.length || (t.comm && t.comm.bytes.step.length)) shown();
      root.dataset.polls = String(Number(root.dataset.polls || 0) + 1);
    } catch (err) {
      tools.note.textContent = `could not load the new steps (${err.message})`;
    }
  }

  async function poll(first) {
    if (first || !SINGLE) await load();
    else await refresh();
    if (!SINGLE) return;  // a comparison is of what is stored now
    try {
      const resp = await fetch(`/api/runs/${RUN}`);
      if (resp.ok) {
        const now = (await resp.json()).state;
        if (now !== state && !["queued", "running"].includes(now)) {
          location.reload();  // ended: the page shows its final events, exit and log
          return;
        }
        state = now;
      }
    } catch (_) {
      // the next poll asks again
    }
    if (["queued", "running"].includes(state)) setTimeout(() => poll(false), REFRESH_MS);
  }

  // ---- tools (the stop button's question is static/confirm.js's) ----
  tools.smoothing.addEventListener("input", () => {
    tools.smoothingValue.textContent = tools.smoothing.value;
    if (data) drawLines();
  });
  tools.x.addEventListener("change", drawAll);
  tools.logY.addEventListener("change", drawAll);
  if (tools.perRank) tools.perRank.addEventListener("change", drawAll);

  for (const id of Object.keys(LINES)) {
    Plotly.newPlot(document.getElementById(id), [], chartLayout(id, false), CONFIG);
  }
  // Linked zoom: a range chosen on one line chart applies to all of them.
  window.traindCharts.linkZoom(Object.keys(LINES).map((id) => document.getElementById(id)));
  poll(true);
})();
