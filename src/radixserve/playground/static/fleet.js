// radixserve playground, fleet view: a running router's workers, refreshed every second.
// Uses app.js's helpers ($, api, chart, pct, COLORS, state); loaded after it.
"use strict";

async function refreshFleet() {
  try {
    const snap = await (await api("/api/fleet")).json();
    state.last.fleet = snap;
    drawFleet(snap);
    drawHistory(snap);
    $("fleet-error").hidden = true;
  } catch (e) {
    $("fleet-error").textContent = e.message;
    $("fleet-error").hidden = false;
  }
}

function drawFleet(snap) {
  $("fleet-router").textContent = snap.router;
  $("fleet-updated").textContent = "Updated " + new Date().toLocaleTimeString() +
    "; holds: KV blocks from the worker's KV events where it publishes them (as the router's " +
    "index counts them, if it has one), else the router's approximate tree for it, in units.";
  const holds = (w) => {
    const blocks = w.kv_index_blocks ?? w.kv_blocks;
    if (blocks != null) return `${blocks} blocks`;
    return w.tree_size_units != null ? `${w.tree_size_units} units` : "-";
  };
  const opt = (v, f) => (v == null ? "-" : f(v));
  document.querySelector("#fleet-table tbody").innerHTML = snap.workers.map((w) => `<tr data-url="${w.url}">
    <td>${w.url}</td><td>${w.healthy ? "yes" : "no"}${w.reachable ? "" : " (unreachable)"}</td><td class="load">${w.load}</td>
    <td>${opt(w.running, String)}</td><td>${opt(w.waiting, String)}</td><td class="hit">${opt(w.hit_rate, pct)}</td>
    <td>${opt(w.kv_usage, pct)}</td><td class="holds">${holds(w)}</td><td class="requests">${w.requests}</td></tr>`).join("");
  chart("chart-fleet", {
    type: "bar",
    data: {
      labels: snap.workers.map((w) => w.url.replace(/^https?:\/\//, "")),
      datasets: [
        { label: "requests routed", data: snap.workers.map((w) => w.requests), backgroundColor: COLORS[0], yAxisID: "y" },
        { label: "hit rate", data: snap.workers.map((w) => w.hit_rate ?? 0), backgroundColor: COLORS[2], yAxisID: "hit" },
      ],
    },
    options: {
      scales: {
        y: { beginAtZero: true, title: { display: true, text: "requests" } },
        hit: { position: "right", min: 0, max: 1, grid: { drawOnChartArea: false }, ticks: { callback: (v) => pct(v) } },
      },
    },
  });
}

// the last minute of each worker's routed requests per second, from its counter's increments
const HISTORY = 60;
function drawHistory(snap) {
  const h = (state.fleetHistory ??= { t: [], prev: null, workers: {} });
  const now = Date.now() / 1000;
  if (h.prev) {
    const dt = Math.max(now - h.prev.t, 1e-3);
    h.t.push(new Date().toLocaleTimeString());
    for (const w of snap.workers) {
      const series = (h.workers[w.url] ??= { delta: [], rps: [] });
      while (series.rps.length < h.t.length - 1) { series.rps.push(null); series.delta.push(0); }
      const d = Math.max(w.requests - (h.prev.requests[w.url] ?? w.requests), 0);
      series.delta.push(d);
      series.rps.push(d / dt);
    }
    if (h.t.length > HISTORY) {
      h.t.shift();
      for (const s of Object.values(h.workers)) { s.rps.shift(); s.delta.shift(); }
    }
  }
  h.prev = { t: now, requests: Object.fromEntries(snap.workers.map((w) => [w.url, w.requests])) };
  chart("chart-fleet-history", {
    type: "line",
    data: {
      labels: [...h.t],
      datasets: Object.entries(h.workers).map(([url, s], i) => ({
        label: url.replace(/^https?:\/\//, "") + " req/s", data: [...s.rps],
        borderColor: COLORS[i % COLORS.length], backgroundColor: COLORS[i % COLORS.length], pointRadius: 0, tension: 0,
      })),
    },
    options: { scales: { y: { beginAtZero: true, title: { display: true, text: "requests routed / s" } } } },
  });
}
