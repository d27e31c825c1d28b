// radixserve playground: controls -> the server's simulator API -> tables and Chart.js charts.
// Every number drawn comes from the API; `window.playground.last` keeps the latest answers so that
// the browser tests can compare what is drawn with what the server said.
"use strict";

// the page's slider ranges (the API accepts wider ones, and refuses what is out of its limits)
const SLIDERS = [
  ["shared_prob", "shared-prefix probability", 0, 1, 0.05],
  ["num_prefixes", "number of prefixes", 1, 32, 1],
  ["system_prompt_len", "system prompt, tokens", 16, 2048, 16],
  ["question_len", "question, tokens", 0, 512, 8],
  ["output_len", "output, tokens", 1, 128, 1],
  ["request_rate", "arrival rate, req/s", 5, 400, 5],
  ["num_requests", "requests", 20, 400, 10],
  ["kv_tokens", "KV pool, tokens", 400, 20000, 100],
  ["max_running_requests", "running slots", 1, 64, 1],
];
const WAIT_STOPS = [0, 10, 30, 100, 300, 1000, 3000, null]; // max_wait_ms slider: null = unbounded
const COLORS = ["#2f6fde", "#e07b24", "#2a9d6f", "#b23a8a", "#7a5cd6", "#c0392b", "#5c6677"];
const pct = (x) => (100 * x).toFixed(1) + "%";
const sec = (x) => (x == null ? "-" : x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s");
const waitLabel = (w) => (w == null ? "unbounded" : w + " ms");
const $ = (id) => document.getElementById(id);

const state = { settings: null, gen: 0, aborter: null, charts: {}, last: {} };
window.playground = state;

async function api(path, body, signal) {
  const resp = await fetch(path, {
    method: body === undefined ? "GET" : "POST",
    headers: { "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!resp.ok) {
    const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
    throw new Error(err.error.message);
  }
  return resp;
}

// NDJSON sweep: calls onPoint for each line as the server finishes it
async function stream(path, body, signal, onPoint) {
  const reader = (await api(path, body, signal)).body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (line.trim()) onPoint(JSON.parse(line));
    }
  }
}

// ---- controls ----------------------------------------------------------------------------
function buildControls(settings) {
  const box = $("sliders");
  for (const [name, label, lo, hi, step] of SLIDERS) {
    box.appendChild(slider(name, label, lo, hi, step, settings[name].default, (v) => v));
  }
  const def = WAIT_STOPS.indexOf(settings.max_wait_ms.default);
  box.appendChild(slider("max_wait_ms", "fairness bound max_wait_ms", 0, WAIT_STOPS.length - 1, 1,
    def < 0 ? 3 : def, (i) => waitLabel(WAIT_STOPS[i])));
  const note = document.createElement("p");
  note.id = "max_wait_ms-note";
  note.className = "note";
  note.textContent = `Starts at ${waitLabel(settings.max_wait_ms.default)}, the default of ` +
    "radixserve serve --max-wait-ms: a request waiting longer is admitted ahead of cache order. " +
    "The fairness chart sweeps it from 0 to unbounded.";
  box.appendChild(note);
  const fs = $("policies");
  for (const p of settings.policies.choices) {
    const l = document.createElement("label");
    const on = settings.policies.default.includes(p) ? "checked" : "";
    l.innerHTML = `<input type="checkbox" name="policy" value="${p}" ${on}> ${p}`;
    fs.appendChild(l);
  }
  fs.addEventListener("change", () => schedule(true));
}

function slider(name, label, lo, hi, step, value, show) {
  const div = document.createElement("div");
  div.className = "slider";
  div.innerHTML = `<label for="${name}">${label}</label><output id="${name}-value"></output>
    <input type="range" id="${name}" name="${name}" min="${lo}" max="${hi}" step="${step}" value="${value}">`;
  const input = div.querySelector("input");
  const out = div.querySelector("output");
  const update = () => { out.textContent = show(Number(input.value)); };
  input.addEventListener("input", () => { update(); schedule(false); });
  update();
  return div;
}

function params() {
  const p = {};
  for (const [name] of SLIDERS) p[name] = Number($(name).value);
  p.max_wait_ms = WAIT_STOPS[Number($("max_wait_ms").value)];
  p.policies = [...document.querySelectorAll("input[name=policy]:checked")].map((e) => e.value);
  return p;
}

// ---- running -----------------------------------------------------------------------------
// controls that change together recompute once; the trace (which depends only on the chosen
// policies) stays stale until a recompute has drawn it, even if a newer one aborted that one
let timer = null;
function schedule(traceToo) {
  clearTimeout(timer);
  state.traceStale = state.traceStale || traceToo;
  timer = setTimeout(recompute, 250);
}

function progress(text, done, total) {
  const box = $("progress");
  box.dataset.state = done < total ? "running" : "idle";
  $("progress-bar").max = total;
  $("progress-bar").value = done;
  $("progress-text").textContent = text;
}

async function recompute() {
  const traceToo = state.traceStale;
  if (state.aborter) state.aborter.abort();
  const aborter = (state.aborter = new AbortController());
  const gen = ++state.gen;
  const p = params();
  const total = 1 + state.settings.curve_total + state.settings.tradeoff_total + (traceToo ? 1 : 0);
  let done = 0;
  const step = (what) => { done += 1; progress(`${what} (${done}/${total})`, done, total); };
  document.body.dataset.busy = "1";
  $("error").hidden = true;
  progress(`simulating (0/${total})`, 0, total);
  try {
    const cmp = await (await api("/api/compare", p, aborter.signal)).json();
    state.last.compare = { params: p, results: cmp.results };
    drawCompare(cmp.results);
    step("compared");
    if (traceToo) {
      const tr = await (await api("/api/trace", p, aborter.signal)).json();
      state.last.trace = tr;
      drawTrace(tr);
      state.traceStale = false;
      step("trace");
    }
    const curve = [];
    await stream("/api/curve", p, aborter.signal, (m) => { curve.push(m.point); drawCurve(curve); step("hit-rate curve"); });
    state.last.curve = { params: p, points: curve };
    const trade = [];
    await stream("/api/tradeoff", p, aborter.signal, (m) => { trade.push(m.point); drawTradeoff(trade); step("fairness sweep"); });
    state.last.tradeoff = { params: p, points: trade };
    progress(`done: ${total} simulations`, total, total);
  } catch (e) {
    if (e.name === "AbortError") return;
    $("error").textContent = e.message;
    $("error").hidden = false;
    progress("error", 1, 1);
  } finally {
    if (gen === state.gen) { delete document.body.dataset.busy; state.done = gen; }
  }
}

// ---- drawing -----------------------------------------------------------------------------
function chart(id, config) {
  if (state.charts[id]) {
    const c = state.charts[id];
    c.data = config.data;
    c.options = config.options;
    c.update("none");
    return c;
  }
  config.options = { responsive: true, maintainAspectRatio: false, animation: false, ...config.options };
  return (state.charts[id] = new Chart($(id), config));
}

function drawCompare(results) {
  const body = document.querySelector("#compare-table tbody");
  body.innerHTML = results.map((r) => `<tr data-policy="${r.policy}"><td>${r.policy}</td>
    <td class="hit">${pct(r.hit_rate)}</td><td class="wait-mean">${sec(r.wait_mean_s)}</td>
    <td class="wait-p99">${sec(r.wait_p99_s)}</td><td>${r.finished}/${r.requests}</td></tr>`).join("");
  drawInsight(results);
  chart("chart-compare", {
    type: "bar",
    data: {
      labels: results.map((r) => r.policy),
      datasets: [{ label: "hit rate", data: results.map((r) => r.hit_rate), backgroundColor: results.map((_, i) => COLORS[i % COLORS.length]) }],
    },
    options: { indexAxis: "y", plugins: { legend: { display: false } }, scales: { x: { min: 0, max: 1, ticks: { callback: (v) => pct(v) } } } },
  });
}

function drawInsight(results) {
  const base = results.find((r) => r.policy === "fcfs") ?? results[0];
  const best = results.reduce((a, r) => (r.hit_rate > a.hit_rate ? r : a), results[0]);
  const saved = base.hit_rate < 1 ? (best.hit_rate - base.hit_rate) / (1 - base.hit_rate) : 0;
  $("insight").textContent = best === base
    ? `${base.policy} reuses the most here: ${pct(base.hit_rate)} of prompt tokens.`
    : `${best.policy} serves ${pct(best.hit_rate)} of prompt tokens from the cache against ` +
      `${base.policy}'s ${pct(base.hit_rate)}: ${pct(saved)} fewer prompt tokens to compute; ` +
      `p99 wait ${sec(best.wait_p99_s)} against ${sec(base.wait_p99_s)}.`;
}

function drawCurve(points) {
  const datasets = state.settings.curve_policies.map((pol, i) => ({
    label: pol,
    data: points.filter((q) => q.policy === pol).map((q) => ({ x: q.shared_prob, y: q.hit_rate })),
    borderColor: COLORS[i], backgroundColor: COLORS[i], tension: 0.2,
  }));
  chart("chart-curve", {
    type: "line",
    data: { datasets },
    options: {
      scales: {
        x: { type: "linear", min: 0, max: 1, title: { display: true, text: "shared-prefix probability" } },
        y: { min: 0, max: 1, title: { display: true, text: "hit rate" }, ticks: { callback: (v) => pct(v) } },
      },
    },
  });
}

// writes each point's fairness bound beside it; equal points share one label ("1000 ms = unbounded").
// Points of a sweep often lie close together, so each label takes the first spot around its point
// (right, left, above, below, then farther out with a leader line) that covers no other label and
// no point, stays inside the plot, and crosses the line least.
const LABEL_FONT = "11px system-ui, sans-serif";
const POINT_RADIUS = 5;
const overlaps = (a, b, pad = 0) =>
  a.x0 < b.x1 + pad && b.x0 < a.x1 + pad && a.y0 < b.y1 + pad && b.y0 < a.y1 + pad;

function labelSpots(pt, w, h) {
  const r = POINT_RADIUS + 3;
  const spots = [];
  for (let ring = 0; ring < 5; ring++) {
    const d = ring * (h + 4);
    const ys = [pt.y - h / 2, pt.y - r - h - d, pt.y + r + d]; // level, above, below
    for (const y of ring ? ys.slice(1) : ys) {
      for (const x of [pt.x + r, pt.x - r - w, pt.x - w / 2]) spots.push({ x0: x, y0: y, x1: x + w, y1: y + h, ring });
    }
  }
  return spots;
}

function crossings(box, segments) {
  let n = 0;
  for (const [a, b] of segments) {
    for (let t = 0; t <= 1; t += 0.05) {
      const x = a.x + t * (b.x - a.x), y = a.y + t * (b.y - a.y);
      if (x > box.x0 && x < box.x1 && y > box.y0 && y < box.y1) { n += 1; break; }
    }
  }
  return n;
}

function placeLabels(c, ctx) {
  const meta = c.getDatasetMeta(0);
  const groups = new Map();
  meta.data.forEach((pt, i) => {
    const key = `${Math.round(pt.x)},${Math.round(pt.y)}`;
    if (!groups.has(key)) groups.set(key, { pt, names: [] });
    groups.get(key).names.push(waitLabel(c.data.datasets[0].data[i].bound));
  });
  const area = c.chartArea;
  const markers = meta.data.map((p) => ({ x0: p.x - POINT_RADIUS, y0: p.y - POINT_RADIUS, x1: p.x + POINT_RADIUS, y1: p.y + POINT_RADIUS }));
  const segments = meta.data.slice(1).map((p, i) => [meta.data[i], p]);
  const placed = [];
  for (const { pt, names } of groups.values()) {
    const text = names.join(" = ");
    const m = ctx.measureText(text);
    const w = m.width, h = m.actualBoundingBoxAscent + m.actualBoundingBoxDescent;
    let best = null, bestCost = Infinity;
    for (const [order, s] of labelSpots(pt, w, h).entries()) {
      const inside = s.x0 >= area.left && s.x1 <= area.right && s.y0 >= area.top && s.y1 <= area.bottom;
      if (!inside || placed.some((o) => overlaps(s, o.box, 3)) || markers.some((o) => overlaps(s, o, 1))) continue;
      const cost = 100 * s.ring + 150 * crossings(s, segments) + order / 100; // a line through the text reads worse than a leader
      if (cost < bestCost) { best = s; bestCost = cost; }
    }
    // nowhere free (a crowded phone-sized chart): the first spot, as before
    placed.push({ text, pt, box: best ?? labelSpots(pt, w, h)[0], ascent: m.actualBoundingBoxAscent });
  }
  return placed;
}

const boundLabels = {
  id: "boundLabels",
  afterDatasetsDraw(c) {
    const ctx = c.ctx;
    ctx.save();
    ctx.font = LABEL_FONT;
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    const placed = placeLabels(c, ctx);
    ctx.fillStyle = "#1d2330";
    ctx.strokeStyle = "#8a93a3";
    ctx.lineWidth = 1;
    for (const { text, pt, box, ascent } of placed) {
      if (box.ring) { // a leader line from the point to the label's nearest edge
        const x = Math.max(box.x0, Math.min(pt.x, box.x1)), y = pt.y < box.y0 ? box.y0 : box.y1;
        ctx.beginPath();
        ctx.moveTo(pt.x, pt.y + Math.sign(y - pt.y) * POINT_RADIUS);
        ctx.lineTo(x, y);
        ctx.stroke();
      }
      ctx.fillText(text, box.x0, box.y0 + ascent);
    }
    ctx.restore();
  },
};

function drawTradeoff(points) {
  $("sweep-policy").textContent = points.length ? points[0].policy : "";
  chart("chart-tradeoff", {
    type: "line",
    plugins: [boundLabels],
    data: {
      datasets: [{
        label: "max_wait_ms",
        data: points.map((q) => ({ x: q.wait_p99_s, y: q.hit_rate, bound: q.max_wait_ms })),
        borderColor: COLORS[1], backgroundColor: COLORS[1], showLine: true, pointRadius: 5,
      }],
    },
    options: {
      plugins: {
        legend: { display: false },
        tooltip: { callbacks: { label: (c) => `bound ${waitLabel(c.raw.bound)}: hit ${pct(c.raw.y)}, p99 wait ${sec(c.raw.x)}` } },
      },
      scales: {
        x: { type: "linear", grace: "8%", title: { display: true, text: "p99 wait (simulated s)" } },
        y: { grace: "8%", title: { display: true, text: "hit rate" }, ticks: { callback: (v) => pct(v) } },
      },
    },
  });
}

function drawTrace(tr) {
  const s = tr.setup;
  $("trace-setup").textContent = `System prompts A and B (${s.system_prompt_len} tokens each) + ` +
    `${s.question_len}-token questions, ${s.output_len} output tokens; arrivals ${s.order.join(", ")}; ` +
    `the engine has room for ${s.room} requests. Bars: waiting (grey), prefill (red: computed, green: prefix hit), decode (blue).`;
  const box = $("trace");
  const xmax = 1000 * Math.max(...Object.values(tr.policies).flat().map((r) => r.finish_s));
  for (const [policy, rows] of Object.entries(tr.policies)) {
    const id = `chart-trace-${policy}`;
    if (!$(id)) {
      const div = document.createElement("div");
      div.className = "trace-policy";
      div.innerHTML = `<h3></h3><div class="chart"><canvas id="${id}"></canvas></div>`;
      box.appendChild(div);
    }
    box.appendChild($(id).closest(".trace-policy")); // in the order of the comparison
    const hits = rows.filter((r) => r.cached_tokens > 0).length;
    const end = Math.max(...rows.map((r) => r.finish_s));
    $(id).closest(".trace-policy").querySelector("h3").textContent =
      `${policy}: ${hits} of ${rows.length} hit their system prompt, all done at ${sec(end)}`;
    const ms = (a, b) => [1000 * a, 1000 * b];
    chart(id, {
      type: "bar",
      data: {
        labels: rows.map((r) => `${r.rid} (hit ${r.cached_tokens}/${r.prompt_tokens})`),
        datasets: [
          { label: "waiting", data: rows.map((r) => ms(r.arrival_s, r.scheduled_s)), backgroundColor: "#c9d1de" },
          { label: "prefill", data: rows.map((r) => ms(r.scheduled_s, r.first_token_s)), backgroundColor: rows.map((r) => (r.cached_tokens ? "#2a9d6f" : "#c0392b")) },
          { label: "decode", data: rows.map((r) => ms(r.first_token_s, r.finish_s)), backgroundColor: "#2f6fde" },
        ],
      },
      options: {
        indexAxis: "y",
        plugins: { legend: { display: false } },
        scales: { x: { min: 0, max: Math.ceil(xmax / 50) * 50, title: { display: true, text: "simulated ms" } }, y: { stacked: true } },
      },
    });
  }
  for (const el of [...box.children]) {
    const policy = el.querySelector("canvas").id.replace("chart-trace-", "");
    if (!(policy in tr.policies)) { state.charts[el.querySelector("canvas").id]?.destroy(); delete state.charts[el.querySelector("canvas").id]; el.remove(); }
  }
}

function showView(view) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === view);
  $("view-sim").hidden = view !== "sim";
  $("view-fleet").hidden = view !== "fleet";
  if (view === "fleet" && !state.fleetTimer) {
    refreshFleet();
    state.fleetTimer = setInterval(refreshFleet, 1000);
  }
}

async function main() {
  const s = await (await api("/api/settings")).json();
  state.settings = {
    ...s, curve_total: s.curve_probs.length * s.curve_policies.length, tradeoff_total: s.wait_sweep_ms.length,
  };
  buildControls(s.settings);
  for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => showView(t.dataset.view));
  if (s.fleet) $("tab-fleet").hidden = false;
  if (location.hash === "#fleet" && s.fleet) showView("fleet");
  state.traceStale = true;
  recompute();
}

document.addEventListener("DOMContentLoaded", main); // after fleet.js too
