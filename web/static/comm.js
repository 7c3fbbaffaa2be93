// Communication page: bus bandwidth against message size from the probe, one line per rank.
// The traces come from the panel's #probe-data (built by traind.web.nodeviews); they are
// drawn again after each refresh (static/refresh.js) into the same, kept chart div.
(() => {
  "use strict";

  if (!window.Plotly) return;

  const COLORS = ["#2457c5", "#e8590c", "#0f8a5f", "#7048e8", "#c2255c", "#1098ad"];
  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif';
  const CONFIG = {
    responsive: true,
    displaylogo: false,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d"],
  };
  const LAYOUT = {
    margin: { l: 60, r: 16, t: 28, b: 44 },
    font: { family: FONT, size: 12, color: "#1d2127" },
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
    // Probe sizes are powers of two from KiB to hundreds of MiB: only a log axis shows them.
    xaxis: { title: { text: "message size" }, type: "log", gridcolor: "#eceef2",
      zeroline: false },
    yaxis: { title: { text: "bus bandwidth (GiB/s)" }, gridcolor: "#eceef2", zeroline: false,
      rangemode: "tozero" },
    showlegend: true,
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },
    hovermode: "x unified",
    uirevision: "busbw", // keeps the user's zoom across refreshes
  };

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
    const xaxis = { ...LAYOUT.xaxis, tickvals: first.x, ticktext: first.text };
    Plotly.react(div, traces, { ...LAYOUT, xaxis }, CONFIG);
  }

  draw();
  document.addEventListener("traind:refreshed", draw);
})();
