// Communication page: bus bandwidth against message size from the probe, one line per rank.
// The traces come from the panel's #probe-data (built by traind.web.nodeviews); they are
// drawn again after each refresh (static/refresh.js) into the same, kept chart div.
(() => {
  "use strict";

  if (!window.Plotly || !window.traindCharts) return;
  const { CONFIG, layout } = window.traindCharts; // one look, dark mode included

  const COLORS = ["#2457c5", "#e8590c", "#0f8a5f", "#7048e8", "#c2255c", "#1098ad"];
  function probeLayout() {
    const base = layout("bus bandwidth (GiB/s)", true, "busbw"); // keeps zoom across refreshes
    return {
      ...base,
      // Probe sizes are powers of two from KiB to hundreds of MiB: only a log axis shows them.
      xaxis: { ...base.xaxis, title: { text: "message size" }, type: "log" },
      yaxis: { ...base.yaxis, rangemode: "tozero" },
    };
  }

  function draw() {
    const div = document.getElementById("chart-busbw");
    const data = document.getElementById("probe-data");
    if (!div || !data) return;
    const traces = JSON.parse(data.textContent).map((t, i) => ({
      type: "scatter",
      mode: "lines+markers",
      name: t.name,
      x: t.x,
      y: t.y,
      text: t.text,
      hovertemplate: "%{text}: %{y:.2f} GiB/s",
      line: { color: COLORS[i % COLORS.length], width: 1.8 },
      marker: { size: 6 },
    }));
    // Ticks at the probe's sizes, labelled as the table labels them (4 KiB, 64 MiB).
    const first = traces[0] || { x: [], text: [] };
    const base = probeLayout();
    const xaxis = { ...base.xaxis, tickvals: first.x, ticktext: first.text };
    Plotly.react(div, traces, { ...base, xaxis }, CONFIG);
  }

  draw();
  document.addEventListener("traind:refreshed", draw);
})();
