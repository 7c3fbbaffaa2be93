// A profile's report page: allocated memory over the traced steps, a line per rank and
// device, from #profile-memory (traind.web.profileviews: rank -> device -> {t_ms, mib}).
(() => {
  "use strict";

  if (!window.Plotly || !window.traindCharts) return;
  const { CONFIG, COLORS, layout, line } = window.traindCharts;
  const data = document.getElementById("profile-memory");
  const div = document.getElementById("chart-memory");
  if (!data || !div) return;
  const traces = [];
  for (const [rank, devices] of Object.entries(JSON.parse(data.textContent))) {
    for (const [device, s] of Object.entries(devices)) {
      const color = COLORS[traces.length % COLORS.length];
      traces.push(line(`rank ${rank} ${device}`, color, { x: s.t_ms, y: s.mib }));
    }
  }
  const base = layout("MiB", traces.length > 1, "memory");
  Plotly.react(div, traces, {
    ...base, xaxis: { ...base.xaxis, title: { text: "ms from the first traced step" } },
  }, CONFIG);
})();
