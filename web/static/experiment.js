// Experiment page: each arm's throughput ratio over the baseline with its interval, as error
// bars around a dashed line at 1 (no change). The numbers come from #verdict-data, built by
// traind.web.views.verdict_chart.
(() => {
  "use strict";

  const div = document.getElementById("chart-verdict");
  const data = document.getElementById("verdict-data");
  if (!window.Plotly || !div || !data) return;

  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif';
  const COLORS = { better: "#0f7a3d", worse: "#b42318", "rejected (quality)": "#b42318",
    "failed (error)": "#b42318" };
  const d = JSON.parse(data.textContent);
  const trace = {
    type: "scatter",
    mode: "markers",
    x: d.ratio,
    y: d.arms,
    text: d.kind,
    error_x: { type: "data", symmetric: false, array: d.plus, arrayminus: d.minus,
      thickness: 2, width: 8, color: "#475467" },
    marker: { size: 11, color: d.kind.map((k) => COLORS[k] || "#2457c5") },
    hovertemplate: "%{y}: %{x:.3f}× (%{text})<extra></extra>",
  };
  const layout = {
    margin: { l: 110, r: 20, t: 16, b: 44 },
    font: { family: FONT, size: 12, color: "#1d2127" },
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
    height: Math.max(160, 70 + 50 * d.arms.length),
    xaxis: { title: { text: `throughput / ${d.baseline}` }, gridcolor: "#eceef2",
      zeroline: false },
    yaxis: { type: "category", automargin: true },
    shapes: [{ type: "line", xref: "x", yref: "paper", x0: 1, x1: 1, y0: 0, y1: 1,
      line: { color: "#98a2b3", dash: "dash", width: 1 } }],
    showlegend: false,
  };
  div.style.height = `${layout.height}px`;
  Plotly.newPlot(div, [trace], layout, { responsive: true, displaylogo: false,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d"] });
})();
