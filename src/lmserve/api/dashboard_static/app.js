// The dashboard page: one SSE stream feeds the live engine view, the step view and the request list; the
// waterfall of one request is fetched on demand (and refreshed while the request is still in flight).

import { TimeChart, fmtMs, fmtNum } from "./charts.js";
import { HttpError, apiFetch, apiJson, apiKey, readEvents, setApiKey } from "./net.js";
import { Playground } from "./playground.js";
import { describeStep, renderSteps, renderWaterfall } from "./waterfall.js";

const $ = (id) => document.getElementById(id);
const INTERVAL = Number(new URLSearchParams(location.search).get("interval")) || 1.0;
const STEPS_SHOWN = 80;
const REQUESTS_KEPT = 100;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const state = {
  now: Date.now() / 1000,
  steps: [], // the newest STEPS_SHOWN step dicts
  stepsTotal: 0,
  requests: [], // timeline dicts, newest first
  previousEngine: null,
  selected: null, // request id shown in the waterfall
  shown: null, // [timelines, inFlight] as last rendered (re-rendered on resize)
  stream: null, // AbortController of the events fetch
};

const charts = {
  requests: new TimeChart($("chart-requests"), $("legend-requests"), {
    integer: true,
    series: [{ label: "running", color: "var(--c-decode)" }, { label: "waiting", color: "var(--c-queue)" }],
  }),
  kv: new TimeChart($("chart-kv"), $("legend-kv"), {
    kind: "area", integer: true,
    // Free blocks are left out: next to thousands of them a busy cache would be a sliver (the tile shows them).
    series: [{ label: "used", color: "var(--c-prefill)" }, { label: "cached free", color: "var(--c-cached)" }],
  }),
  positions: new TimeChart($("chart-positions"), $("legend-positions"), {
    kind: "bars", integer: true,
    series: [{ label: "decode", color: "var(--c-decode)" }, { label: "prefill", color: "var(--c-prefill)" }],
  }),
  duration: new TimeChart($("chart-duration"), $("legend-duration"), {
    kind: "bars", digits: 1,
    series: [{ label: "forward", color: "var(--c-prefill)" }, { label: "other", color: "var(--c-hold)" }],
  }),
  tps: new TimeChart($("chart-tps"), $("legend-tps"), {
    digits: 1, series: [{ label: "tokens/s", color: "var(--c-decode)" }],
  }),
  preempt: new TimeChart($("chart-preempt"), $("legend-preempt"), {
    kind: "bars", integer: true, series: [{ label: "preempted", color: "var(--c-abort)" }],
  }),
};

// Canvas charts resolve colors themselves: CSS variables mean nothing to a 2D context.
for (const chart of Object.values(charts)) {
  for (const s of chart.series) {
    const name = s.color.match(/^var\((--[\w-]+)\)$/)?.[1];
    if (name) s.color = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }
  chart.renderLegend();
}

// ------------------------------------------------------------------------------------------- connection

function setConnection(kind, text) {
  const node = $("conn-status");
  node.dataset.state = kind;
  node.textContent = text;
}

async function streamEvents() {
  for (;;) {
    state.stream = new AbortController();
    setConnection("connecting", "connecting…");
    let first = true;
    try {
      const response = await apiFetch(`/dashboard/api/events?interval=${INTERVAL}`, { signal: state.stream.signal });
      setConnection("live", "live");
      await readEvents(response, (data) => {
        onEvent(JSON.parse(data), first);
        first = false;
      });
      setConnection("down", "stream ended, reconnecting…");
    } catch (error) {
      if (error instanceof HttpError && error.status === 401) {
        setConnection("auth", "API key needed");
        $("api-key").focus();
        await new Promise((resolve) => state.stream.signal.addEventListener("abort", resolve, { once: true }));
        continue;
      }
      if (error.name !== "AbortError") setConnection("down", `disconnected (${error.message}), retrying…`);
    }
    if (!state.stream.signal.aborted) await sleep(2000);
  }
}

function reconnect() {
  state.stream?.abort();
}

// ------------------------------------------------------------------------------------------- events

function onEvent(event, first) {
  state.now = event.time;
  updateTiles(event);
  for (const step of event.steps) {
    const decode = Object.values(step.decode).reduce((a, b) => a + b, 0);
    const prefill = Object.values(step.prefill).reduce((a, b) => a + b, 0);
    charts.positions.push(step.end_unix, [decode, prefill]);
    const forwardMs = step.forward_s * 1000;
    charts.duration.push(step.end_unix, [forwardMs, Math.max(0, step.duration_s * 1000 - forwardMs)]);
  }
  const engine = event.engine;
  if (engine.kv_blocks_total != null) {
    charts.requests.push(event.time, [engine.num_requests_running, engine.num_requests_waiting]);
    const cached = engine.kv_blocks_cached_free || 0;
    charts.kv.push(event.time, [engine.kv_blocks_used, cached]);
    $("kv-total").textContent = `of ${fmtNum(engine.kv_blocks_total)}`;
  }
  charts.tps.push(event.time, [event.tokens_per_s]);
  if (!first) charts.preempt.push(event.time, [event.steps.reduce((n, s) => n + s.preempted.length, 0)]);
  for (const chart of Object.values(charts)) chart.draw(state.now);

  state.steps = (first ? event.steps : [...state.steps, ...event.steps]).slice(-STEPS_SHOWN);
  state.stepsTotal += event.steps.length;
  drawSteps();
  addRequests(event.finished, first);
}

function updateTiles(event) {
  const e = event.engine;
  const prev = state.previousEngine;
  $("running-count").textContent = fmtNum(e.num_requests_running);
  $("waiting-count").textContent = fmtNum(e.num_requests_waiting);
  $("finished-count").textContent = fmtNum(event.num_finished);
  $("tokens-per-s").textContent = fmtNum(event.tokens_per_s, 1);
  const durations = event.steps.map((s) => s.duration_s);
  $("step-ms").textContent = durations.length
    ? fmtNum((1000 * durations.reduce((a, b) => a + b, 0)) / durations.length, 1) : "idle";
  $("preemptions").textContent = fmtNum(e.num_preemptions);
  // The hit rate of this interval when it looked anything up, else since the start.
  const queries = (e.prefix_cache_queries || 0) - (prev?.prefix_cache_queries || 0);
  const recent = prev && queries > 0;
  const hits = recent ? e.prefix_cache_hits - prev.prefix_cache_hits : e.prefix_cache_hits;
  const asked = recent ? queries : e.prefix_cache_queries;
  $("prefix-hit").textContent = asked ? `${fmtNum((100 * hits) / asked, 1)}%` : "–";
  $("prefix-hit-label").textContent = recent ? "prefix hits, last interval" : "prefix hits, all time";
  if (e.kv_blocks_total) {
    const cached = e.kv_blocks_cached_free || 0;
    const parts = { used: e.kv_blocks_used, cached, free: e.kv_blocks_free - cached };
    for (const [name, value] of Object.entries(parts)) {
      $("kv-bar").querySelector(`.${name}`).style.width = `${(100 * value) / e.kv_blocks_total}%`;
    }
    $("kv-text").textContent = `KV blocks: ${parts.used} used · ${cached} cached free · ${parts.free} free`;
    $("kv-bar").title = `${e.kv_blocks_total} blocks, ${fmtNum(100 * e.kv_cache_usage_perc, 1)}% in use`;
  }
  updateReplicas(e.engines || []);
  if (event.engine_error) setConnection("down", `engine: ${event.engine_error}`);
  else if ($("conn-status").dataset.state !== "live") setConnection("live", "live");
  state.previousEngine = e;
}

// Data parallel: one row per engine replica (the tiles above show their sums); hidden for a single engine.
function updateReplicas(engines) {
  $("replicas").hidden = engines.length < 2;
  if (engines.length < 2) return;
  const ofTotal = (part, whole) =>
    `${fmtNum(part)} of ${fmtNum(whole)}` + (whole ? ` (${fmtNum((100 * part) / whole, 1)}%)` : "");
  const rows = engines.map((r) => {
    const tr = document.createElement("tr");
    const cells = [r.engine, fmtNum(r.num_requests_running), fmtNum(r.num_requests_waiting),
      ofTotal(r.kv_blocks_used, r.kv_blocks_total), ofTotal(r.prefix_cache_hits, r.prefix_cache_queries),
      fmtNum(r.num_preemptions), fmtNum(r.num_steps)];
    for (const text of cells) tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    return tr;
  });
  $("replicas").querySelector("tbody").replaceChildren(...rows);
}

function drawSteps() {
  const container = $("step-chart");
  renderSteps(container, state.steps, openRequest, (step) => ($("step-info").textContent = describeStep(step)));
  container.dataset.stepsTotal = String(state.stepsTotal);
}

// ------------------------------------------------------------------------------------------- request list

function addRequests(finished, replace) {
  const newest = [...finished].reverse();
  const fresh = new Set(newest.map((t) => t.request_id));
  const kept = replace ? [] : state.requests.filter((t) => !fresh.has(t.request_id));
  state.requests = [...newest, ...kept].slice(0, REQUESTS_KEPT);
  renderList();
}

function renderList() {
  const body = $("request-list").tBodies[0];
  if (!state.requests.length) {
    body.innerHTML = '<tr class="empty"><td colspan="6">no finished requests yet</td></tr>';
    return;
  }
  body.replaceChildren(...state.requests.map((t) => {
    const row = document.createElement("tr");
    row.dataset.requestId = t.request_id;
    if (t.request_id === state.selected) row.classList.add("selected");
    const reason = t.finish_reason || "–";
    const cells = [
      new Date(t.arrival_unix * 1000).toLocaleTimeString(),
      t.request_id.length > 20 ? `${t.request_id.slice(0, 19)}…` : t.request_id,
      reason,
      `${t.num_prompt_tokens} → ${t.num_output_tokens}`,
      fmtMs(t.intervals.ttft, 0),
      fmtMs(t.intervals.e2e, 0),
    ];
    cells.forEach((text, i) => {
      const cell = document.createElement("td");
      if (i === 2) {
        const badge = document.createElement("span");
        badge.className = `badge ${reason}`;
        badge.textContent = text;
        cell.append(badge);
      } else {
        cell.textContent = text;
      }
      if (i >= 3) cell.className = "num";
      if (i === 1) cell.title = t.request_id;
      row.append(cell);
    });
    row.addEventListener("click", () => openRequest(t.request_id));
    return row;
  }));
}

// ------------------------------------------------------------------------------------------- waterfall

let refreshTimer = null;

async function openRequest(id, retries = 0) {
  clearTimeout(refreshTimer);
  if (state.selected !== id) {
    state.selected = id;
    $("request-id-input").value = id;
    renderList();
  }
  const container = $("waterfall");
  try {
    const body = await apiJson(`/dashboard/api/requests/${encodeURIComponent(id)}`);
    if (state.selected !== id) return;
    state.shown = [body.data, body.in_flight];
    renderWaterfall(container, body.data, body.in_flight);
    // Follow a request while it runs: its stamps and steps keep coming until it is recorded.
    if (body.in_flight) refreshTimer = setTimeout(() => openRequest(id), 1000);
  } catch (error) {
    if (state.selected !== id) return;
    // Between leaving the engine client and being recorded a request is briefly in neither place.
    if (error.status === 404 && retries < 5) {
      refreshTimer = setTimeout(() => openRequest(id, retries + 1), 300);
      return;
    }
    state.shown = null;
    container.innerHTML = "";
    const message = document.createElement("p");
    message.className = "error";
    message.textContent = error.message;
    container.append(message);
  }
}

// ------------------------------------------------------------------------------------------- wiring

function init() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    setApiKey($("api-key").value.trim());
    reconnect();
    loadModelName();
  });
  $("request-search").addEventListener("submit", (e) => {
    e.preventDefault();
    const id = $("request-id-input").value.trim();
    if (id) openRequest(id);
  });
  $("pg-request-id").addEventListener("click", (e) => {
    e.preventDefault();
    openRequest(e.target.dataset.requestId);
  });
  new Playground({
    onRequest: (id) => openRequest(id),
    onDone: (id) => setTimeout(() => openRequest(id), 300),
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const chart of Object.values(charts)) chart.draw(state.now);
      drawSteps();
      if (state.shown) renderWaterfall($("waterfall"), ...state.shown);
    }, 150);
  });
  loadModelName();
  streamEvents();
}

async function loadModelName() {
  try {
    const models = await apiJson("/v1/models");
    $("model-name").textContent = models.data.map((m) => m.id).join(", ");
  } catch {
    $("model-name").textContent = "";
  }
}

init();
