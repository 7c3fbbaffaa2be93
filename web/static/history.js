// Communication and Hardware pages: the charts over time, from the panel's #history-data
// (chart specs built by traind.web.historyviews: times in unix seconds, values already in
// the axis' unit). Drawn again after each refresh (static/refresh.js) into the same, kept
// chart divs, so a zoom survives; the look is charts.js' (dark mode included).
(() => {
  "use strict";

  if (!window.Plotly || !window.traindCharts) return;
  const { CONFIG, COLORS, layout, line } = window.traindCharts;

  function draw() {
    const data = document.getElementById("history-data");
    if (!data) return;
    for (const spec of JSON.parse(data.textContent)) {
      const div = document.getElementById(`chart-${spec.key}`);
      if (!div) continue;
      // One colour per series name without its percentile or direction ("all_reduce p95",
      // "GPU 0 rx"): a GPU's tx and rx, an op's p50..p99, share it and differ by dash.
      const bases = [];
      const traces = spec.traces.map((t) => {
        const base = t.name.replace(/ (p\d\d|tx|rx)$/, "");
        if (!bases.includes(base)) bases.push(base);
        return line(t.name, COLORS[bases.indexOf(base) % COLORS.length], {
          x: t.t.map((s) => new Date(s * 1000)),
          y: t.y,
          line: { color: COLORS[bases.indexOf(base) % COLORS.length], width: 1.8,
            dash: t.dash || "solid" },
          connectgaps: false,
        });
      });
      const base = layout(spec.unit, traces.length > 1, spec.key);
      // A log axis spanning decades labels the decades only (dtick 1): Plotly's default
      // labels 2 and 5 of each too, which crowds a small chart. Within one decade the
      // default stays (dtick 1 would leave it unlabelled).
      const ys = spec.traces.flatMap((t) => t.y).filter((v) => v > 0);
      const decades = ys.length && Math.max(...ys) / Math.min(...ys) >= 10;
      Plotly.react(div, traces, {
        ...base,
        xaxis: { ...base.xaxis, type: "date", title: { text: "" } },
        yaxis: { ...base.yaxis, type: spec.log ? "log" : "linear",
          rangemode: spec.log ? "normal" : "tozero",
          ...(spec.log && decades ? { dtick: 1 } : {}) },
      }, CONFIG);
    }
  }

  draw();
  document.addEventListener("traind:refreshed", draw);
})();
