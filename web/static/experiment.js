// Experiment page: each arm's throughput ratio over the baseline with its interval, as error
// bars around a dashed line at 1 (no change), from #verdict-data (views.verdict_chart); and
// each arm's throughput per block or trial, a line per arm, from #blocks-data
// (experimentviews.blocks_chart). Colours and theme from charts.js.
(() => {
  "use strict";

  const charts = window.traindCharts;
  if (!window.Plotly || !charts) return;
  const read = (id) => {
    const el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  };
  const css = (name, fallback) =>
    getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;

  const verdict = read("verdict-data");
  const vdiv = document.getElementById("chart-verdict");
  if (verdict && vdiv) {
    const COLORS = { better: "#0f7a3d", worse: "#b42318", "rejected (quality)": "#b42318",
      "failed (error)": "#b42318" };
    const trace = {
      type: "scatter",
      mode: "markers",
      x: verdict.ratio,
      y: verdict.arms,
      text: verdict.kind,
      error_x: { type: "data", symmetric: false, array: verdict.plus,
        arrayminus: verdict.minus, thickness: 2, width: 8, color: css("--chart-text", "#475467") },
      marker: { size: 11, color: verdict.kind.map((k) => COLORS[k] || "#2457c5") },
      hovertemplate: "%{y}: %{x:.3f}× (%{text})<extra></extra>",
    };
    const layout = charts.layout(`throughput / ${verdict.baseline}`, false, 0);
    layout.margin = { l: 110, r: 20, t: 16, b: 44 };
    layout.height = Math.max(160, 70 + 50 * verdict.arms.length);
    layout.xaxis.title.text = `throughput / ${verdict.baseline}`;
    layout.yaxis = { type: "category", automargin: true };
    layout.hovermode = "closest";
    layout.shapes = [{ type: "line", xref: "x", yref: "paper", x0: 1, x1: 1, y0: 0, y1: 1,
      line: { color: "#98a2b3", dash: "dash", width: 1 } }];
    vdiv.style.height = `${layout.height}px`;
    Plotly.newPlot(vdiv, [trace], layout, charts.CONFIG);
  }

  const blocks = read("blocks-data");
  const bdiv = document.getElementById("chart-blocks");
  if (blocks && bdiv) {
    const traces = blocks.traces.map((t) => ({
      type: "scatter",
      mode: "lines+markers",
      name: t.name,
      x: t.x,
      y: t.y,
      customdata: t.loss.map((l, i) => [l === null ? "–" : l.toFixed(4), t.step[i] ?? "–"]),
      line: { color: t.color, width: 1.5 },
      marker: { color: t.color, size: 6 },
      hovertemplate: `${t.name}: %{y:,.0f} tokens/s<br>${blocks.x_title} %{x}, step %{customdata[1]}, `
        + "loss %{customdata[0]}<extra></extra>",
    }));
    const layout = charts.layout("tokens/s", true, 0);
    layout.xaxis.title.text = blocks.x_title;
    layout.hovermode = "closest";
    Plotly.newPlot(bdiv, traces, layout, charts.CONFIG);
  }
})();
