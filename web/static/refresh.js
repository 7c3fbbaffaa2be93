// Hardware and communication pages: every 5 s, fetch the server-rendered panel again
// (the element's data-refresh URL) and swap it in. Units are formatted on the server
// (traind.web.views), so there is no formatting to repeat here.
(() => {
  "use strict";

  const region = document.querySelector("[data-refresh]");
  if (!region) return;

  const INTERVAL_MS = 5000;
  const conn = document.getElementById("conn");
  let failures = 0;

  function setConn(status, text) {
    if (!conn) return;
    conn.dataset.status = status;
    conn.textContent = text;
  }

  // Elements marked data-keep (a plotly chart) survive the swap: the old node replaces its
  // fresh, empty twin, so the chart keeps its zoom and is only given new data.
  function swap(html) {
    const kept = [...region.querySelectorAll("[data-keep][id]")];
    region.innerHTML = html;
    for (const old of kept) {
      const twin = document.getElementById(old.id);
      if (twin) twin.replaceWith(old);
    }
    document.dispatchEvent(new CustomEvent("traind:refreshed"));
  }

  async function refresh() {
    // A background tab does not make the daemon read NVML every 5 s for nobody.
    if (!document.hidden) {
      try {
        const resp = await fetch(region.dataset.refresh, { cache: "no-store" });
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        swap(await resp.text());
        failures = 0;
        setConn("live", "live");
      } catch (_) {
        // The daemon restarting or the network gone: keep the last numbers, say they are old.
        failures += 1;
        setConn("reconnecting", failures > 1 ? `stale (${failures} tries failed)` : "stale");
      }
    }
    // Scheduled after the fetch, not on an interval: slow answers never pile up.
    setTimeout(refresh, INTERVAL_MS);
  }

  setTimeout(refresh, INTERVAL_MS);
})();
