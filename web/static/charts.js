// What the overview (app.js) and a run's page (run.js) draw alike: one look for every chart,
// and adaptive precision's switches as a Gantt chart of spans per group.
(() => {
  "use strict";

  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif';
  const CONFIG = {
    responsive: true,
    displaylogo: false,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d"],
  };
  const MODE_COLORS = { fp32: "#2457c5", bf16: "#e8590c", fp16: "#0f8a5f", fp8: "#7048e8" };
  // Lines of one chart that are not a named figure (ranks, series), in turn.
  const COLORS = ["#2457c5", "#e8590c", "#0f8a5f", "#7048e8", "#c2255c", "#1098ad",
    "#5c940d", "#ae3ec9"];
  // Follows the page's colour scheme (style.css sets --chart-* under prefers-color-scheme).
  const css = (name, fallback) =>
    getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;

  // ``revision``: Plotly keeps the user's zoom while it is unchanged.
  function layout(yTitle, showLegend, revision) {
    const grid = css("--chart-grid", "#eceef2");
    return {
      margin: { l: 60, r: 16, t: showLegend ? 28 : 8, b: 40 },
      font: { family: FONT, size: 12, color: css("--chart-text", "#1d2127") },
      paper_bgcolor: css("--chart-bg", "#ffffff"),
      plot_bgcolor: css("--chart-bg", "#ffffff"),
      xaxis: { title: { text: "step" }, gridcolor: grid, zeroline: false },
      yaxis: { title: { text: yTitle }, gridcolor: grid, zeroline: false, rangemode: "normal" },
      showlegend: showLegend,
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },
      hovermode: "x unified",
      uirevision: String(revision),
    };
  }

  const line = (name, color, extra) => ({
    type: "scatter", mode: "lines", name, x: [], y: [],
    line: { color, width: 1.8 }, ...extra,
  });

  // Each group's spans of one precision, from its switches in step order: a group starts in
  // the mode its first switch left (else the mode its windows report; adaptive starts in
  // fp32), and its last span runs to the newest step seen.
  function precisionSpans(switches, windows, end) {
    const groups = [];
    const add = (g) => { if (!groups.includes(g)) groups.push(g); };
    for (const w of windows) w.groups.forEach(add);
    for (const sw of switches) add(sw.group);
    const spans = [];
    for (const g of groups) {
      const own = switches.filter((sw) => sw.group === g).sort((a, b) => a.step - b.step);
      const seen = windows.find((w) => w.groups.includes(g));
      let mode = own.length ? own[0].before : (seen ? seen.modes[seen.groups.indexOf(g)] : "fp32");
      let start = 0;
      for (const sw of own) {
        if (sw.step > start) spans.push({ group: g, mode, start, end: sw.step });
        mode = sw.after;
        start = sw.step;
      }
      spans.push({ group: g, mode, start, end: Math.max(start, end) });
    }
    return { groups, spans };
  }

  // The Gantt chart itself: one horizontal bar per span, from its first step for its length.
  function drawPrecision(div, switches, windows, end, revision) {
    const { groups, spans } = precisionSpans(switches, windows, end);
    const modes = [...new Set(spans.map((sp) => sp.mode))];
    const bars = modes.map((mode) => {
      const own = spans.filter((sp) => sp.mode === mode);
      return {
        type: "bar", orientation: "h", name: mode,
        y: own.map((sp) => sp.group), base: own.map((sp) => sp.start),
        x: own.map((sp) => sp.end - sp.start),
        marker: { color: MODE_COLORS[mode] || "#868e96" },
        hovertemplate: `%{y}: ${mode} from step %{base} for %{x} steps<extra></extra>`,
      };
    });
    Plotly.react(div, bars, {
      ...layout("", true, revision), barmode: "overlay", hovermode: "closest",
      yaxis: { type: "category", categoryorder: "array", categoryarray: groups,
               autorange: "reversed", gridcolor: css("--chart-grid", "#eceef2") },
    }, CONFIG);
    return groups;
  }

  // ---- chart tools (the overview's and a run's page) ----
  // TensorBoard's debiased EMA: the first points are not pulled toward zero.
  function ema(ys, alpha) {
    if (!alpha) return ys;
    const out = [];
    let acc = 0;
    let n = 0;
    for (const y of ys) {
      if (y === null || !isFinite(y)) { out.push(null); continue; }
      acc = acc * alpha + (1 - alpha) * y;
      n += 1;
      out.push(acc / (1 - alpha ** n));
    }
    return out;
  }

  // The x of each point by the tools' axis: its step, minutes since ``t0`` (by default the
  // first point's time), or the wall time (unix seconds in ``times``; a point without one
  // has no x).
  function xValues(mode, steps, times, t0) {
    if (mode === "step") return steps;
    if (mode === "wall") return times.map((t) => (t ? new Date(t * 1000) : null));
    const start = t0 ?? (times.find((t) => t) || 0);
    return times.map((t) => (t ? (t - start) / 60 : null));
  }
  const X_TITLE = { step: "step", relative: "minutes since the first step", wall: "time" };

  // Linked zoom: a range chosen on one of ``divs`` applies to all of them.
  function linkZoom(divs) {
    let linking = false;
    for (const div of divs) {
      div.on("plotly_relayout", (ev) => {
        if (linking) return;
        // A drag sends the range's ends; a relayout call may send the range whole.
        const range = ev["xaxis.range[0]"] !== undefined
          ? [ev["xaxis.range[0]"], ev["xaxis.range[1]"]] : (ev["xaxis.range"] || null);
        const reset = ev["xaxis.autorange"] === true;
        if (!range && !reset) return;
        linking = true;
        const update = range ? { "xaxis.range": range } : { "xaxis.autorange": true };
        Promise.all(divs.filter((o) => o !== div).map((o) => Plotly.relayout(o, update)))
          .finally(() => { linking = false; });
      });
    }
  }

  window.traindCharts = { FONT, CONFIG, COLORS, MODE_COLORS, layout, line, precisionSpans,
    drawPrecision, ema, xValues, X_TITLE, linkZoom };
})();
