// The request waterfall (where one request's time went, from its timeline stamps) and the step view (which
// requests shared each engine step's positions).

import { axisScale, fmtMs, fmtNum, requestHue } from "./charts.js";

const SVG = "http://www.w3.org/2000/svg";

// One lane per kind of stage, top to bottom in the order a request lives through them.
const LANES = [
  ["input", "input processing", "var(--c-input)"],
  ["to_engine", "to engine", "var(--c-to-engine)"],
  ["queue", "queue", "var(--c-queue)"],
  ["prefill", "prefill", "var(--c-prefill)"],
  ["decode", "decode", "var(--c-decode)"],
  ["hold_back", "detok hold-back", "var(--c-hold)"],
  ["output", "output", "var(--c-output)"],
  ["transport", "transport", "var(--c-transport)"],
];

export function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text != null) node.textContent = text;
  return node;
}

function html(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text != null) node.textContent = text;
  return node;
}

// Stages (seconds since arrival), in order of start. Steps are [index, start, end, positions, prefill, tokens] and,
// for a span that merges several engine steps (a long request's kept timeline), a seventh: how many.
// Prefill chunks are one stage each; consecutive decode steps form one stage (a preemption splits them).
export function stagesOf(timeline) {
  const s = timeline.stamps;
  const stages = [];
  const add = (stage, label, start, end, detail = "", bars = null) => {
    if (start == null || end == null || end < start) return;
    stages.push({ stage, label, start, end, detail, bars: bars || [[start, end]] });
  };
  add("input", "input processing", s.arrival, s.input_processed, `${timeline.num_prompt_tokens} prompt tokens`);
  add("to_engine", "to engine", s.input_processed, s.queued);
  add("queue", "queue", s.queued, s.scheduled);
  let chunks = 0;
  let run = null;
  for (const [, start, end, positions, prefill, tokens, merged = 1] of timeline.steps) {
    if (prefill) {
      run = null;
      chunks += merged;
      const label = merged > 1 ? `prefill chunks ${chunks - merged + 1}-${chunks}` : `prefill chunk ${chunks}`;
      const sampled = !tokens ? "" : merged > 1 ? `, ${tokens} tokens` : ", first token";
      add("prefill", label, start, end, `${positions} positions${sampled}`);
    } else if (run) {
      run.end = end;
      run.steps += merged;
      run.tokens += tokens;
      run.bars.push([start, end]);
    } else {
      run = { stage: "decode", label: "decode", start, end, steps: merged, tokens, bars: [[start, end]] };
      stages.push(run);
    }
  }
  for (const r of stages.filter((st) => st.stage === "decode")) r.detail = `${r.steps} steps, ${r.tokens} tokens`;
  add("hold_back", "detokenizer hold-back", s.first_token, s.first_chunk);
  const lastStepEnd = timeline.steps.length ? timeline.steps.at(-1)[2] : null;
  const aborted = timeline.finish_reason === "abort";
  add("output", aborted ? "until abort (last step → aborted)" : "output (last step → finished)", lastStepEnd, s.finished);
  add("transport", "transport (finished → last byte)", s.finished, s.last_byte);
  return stages.sort((a, b) => a.start - b.start);
}

function endOf(timeline) {
  const s = timeline.stamps;
  const ends = [s.finished, s.last_byte, s.first_chunk, ...timeline.steps.map((st) => st[2])];
  return Math.max(1e-3, ...ends.filter((v) => v != null));
}

function summary(timeline, inFlight) {
  const i = timeline.intervals;
  const reason = inFlight ? "in flight" : timeline.finish_reason || "–";
  const box = html("div", { class: "wf-summary" });
  const title = html("div", { class: "wf-title" });
  title.append(html("code", {}, timeline.request_id), html("span", { class: `badge ${reason.replace(" ", "-")}` }, reason));
  if (timeline.parent_id !== timeline.request_id) title.append(html("span", { class: "muted" }, ` of ${timeline.parent_id}`));
  const facts = [
    ["arrived", new Date(timeline.arrival_unix * 1000).toLocaleTimeString()],
    ["prompt", fmtNum(timeline.num_prompt_tokens)],
    ["cached", fmtNum(timeline.num_cached_tokens)],
    ["output", fmtNum(timeline.num_output_tokens)],
    ["preemptions", fmtNum(timeline.num_preemptions)],
    ["TTFT", fmtMs(i.ttft)],
    ["TPOT", fmtMs(i.tpot)],
    ["E2E", fmtMs(i.e2e)],
  ];
  const list = html("dl", { class: "facts" });
  for (const [name, value] of facts) list.append(html("dt", {}, name), html("dd", {}, value));
  box.append(title, list);
  return box;
}

function timeAxis(group, x, total, top, height) {
  const step = niceStep(total);
  const label = (t) => (step >= 1 ? `${Math.round(t)} s` : `${(t * 1000).toFixed(step >= 0.001 ? 0 : 1)} ms`);
  for (let t = 0; t <= total + 1e-9; t += step) {
    group.append(svg("line", { x1: x(t), x2: x(t), y1: top, y2: top + height, class: "grid" }));
    group.append(svg("text", { x: x(t), y: top + height + 12, class: "axis", "text-anchor": "middle" }, label(t)));
  }
}

function niceStep(total) {
  const raw = total / 6;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= raw);
}

function mark(group, kind, x, top, height, label, width) {
  const g = svg("g", { class: `mark ${kind}`, "data-mark": kind });
  g.append(svg("line", { x1: x, x2: x, y1: top - 4, y2: top + height }));
  // Labels near the right edge go to the left of their line, so they are not cut off.
  const flip = x > width - 80;
  g.append(svg("text", { x: flip ? x - 3 : x + 3, y: top - 6, "text-anchor": flip ? "end" : "start" }, label));
  group.append(g);
}

function bars(timeline, stages, width) {
  const laneH = 16, gap = 4, labelW = 130, top = 18;
  const height = LANES.length * (laneH + gap);
  const total = endOf(timeline);
  const x = (t) => labelW + ((width - labelW - 12) * t) / total;
  const root = svg("svg", { width, height: top + height + 18, class: "wf-bars" });
  timeAxis(root, x, total, top, height);
  LANES.forEach(([key, label, color], lane) => {
    const y = top + lane * (laneH + gap);
    root.append(svg("text", { x: 0, y: y + laneH - 4, class: "lane" }, label));
    for (const stage of stages.filter((st) => st.stage === key)) {
      for (const [start, end] of stage.bars) {
        const rect = svg("rect", {
          x: x(start), y, height: laneH, fill: color, "data-stage": key,
          width: Math.max(1.5, x(end) - x(start)),
        });
        rect.append(svg("title", {}, `${stage.label}: ${fmtMs(end - start, 2)} (at ${fmtMs(start, 1)})`));
        root.append(rect);
      }
    }
  });
  const s = timeline.stamps;
  if (s.first_token != null) mark(root, "first-token", x(s.first_token), top, height, "first token", width);
  for (const t of timeline.preemptions) mark(root, "preemption", x(t), top, height, "preempted", width);
  if (timeline.finish_reason === "abort" && s.finished != null) {
    mark(root, "abort", x(s.finished), top, height, "abort", width);
  }
  return root;
}

function table(stages) {
  const t = html("table", { class: "wf-table" });
  t.innerHTML = "<thead><tr><th></th><th>stage</th><th>start</th><th>duration</th><th>detail</th></tr></thead>";
  const body = html("tbody");
  for (const st of stages) {
    const ms = (st.end - st.start) * 1000;
    const row = html("tr", { "data-stage": st.stage, "data-start-ms": (st.start * 1000).toFixed(3), "data-ms": ms.toFixed(3) });
    const swatch = html("td");
    swatch.append(html("i", { class: "swatch", style: `background:${LANES.find(([k]) => k === st.stage)[2]}` }));
    row.append(swatch, html("td", {}, st.label), html("td", { class: "num" }, (st.start * 1000).toFixed(1)),
      html("td", { class: "num" }, ms.toFixed(1)), html("td", { class: "muted" }, st.detail));
    body.append(row);
  }
  t.append(body);
  return t;
}

// Renders every timeline of one request (one per choice when n > 1) into `container`.
export function renderWaterfall(container, timelines, inFlight) {
  const width = Math.max(420, container.clientWidth - 24);
  container.replaceChildren();
  container.dataset.requestId = timelines[0]?.request_id || "";
  container.dataset.inFlight = inFlight ? "1" : "0";
  for (const timeline of timelines) {
    const stages = stagesOf(timeline);
    const block = html("div", { class: "wf-request", "data-request-id": timeline.request_id });
    block.dataset.aborted = timeline.finish_reason === "abort" ? "1" : "0";
    block.append(summary(timeline, inFlight), bars(timeline, stages, width), table(stages));
    container.append(block);
  }
}

// ---------------------------------------------------------------------------------------------- step view

export function renderSteps(container, steps, onPick, onHover) {
  const width = Math.max(300, container.clientWidth);
  const height = 170, left = 36, bottom = 16, top = 6;
  const plotH = height - top - bottom;
  const maxPositions = Math.max(1, ...steps.map((s) => total(s)));
  const scale = axisScale(maxPositions, true);
  const yMax = scale.top;
  // Newest step at the right edge, as in the time charts; a few steps do not stretch to fill the width.
  const slot = (width - left) / Math.max(steps.length, 40);
  const x0 = width - steps.length * slot;
  const y = (v) => top + plotH * (1 - v / yMax);
  const root = svg("svg", { width, height, class: "steps" });
  root.append(hatchPattern());
  for (let value = 0; value <= yMax; value += scale.step) {
    root.append(svg("line", { x1: left, x2: width, y1: y(value), y2: y(value), class: "grid" }));
    root.append(svg("text", { x: left - 4, y: y(value) + 3, class: "axis", "text-anchor": "end" }, value));
  }
  steps.forEach((step, i) => {
    const x = x0 + i * slot + 1;
    let bottomValue = 0;
    const parts = [
      ...Object.entries(step.decode).map(([id, n]) => [id, n, false]),
      ...Object.entries(step.prefill).map(([id, n]) => [id, n, true]),
    ];
    for (const [id, n, prefill] of parts) {
      const attrs = { x, y: y(bottomValue + n), width: Math.max(1, slot - 2), height: y(bottomValue) - y(bottomValue + n) };
      const g = svg("g", { class: "seg", "data-request-id": id, "data-kind": prefill ? "prefill" : "decode" });
      g.append(svg("rect", { ...attrs, fill: `hsl(${requestHue(id)} 60% ${prefill ? 45 : 60}%)` }));
      if (prefill) g.append(svg("rect", { ...attrs, fill: "url(#hatch)" }));
      g.append(svg("title", {}, `step ${step.index}: ${id} — ${n} ${prefill ? "prefill" : "decode"} position${n > 1 ? "s" : ""}`));
      g.addEventListener("click", () => onPick(id));
      g.addEventListener("mouseenter", () => onHover(step));
      root.append(g);
      bottomValue += n;
    }
  });
  if (!steps.length) {
    root.append(svg("text", { x: (left + width) / 2, y: height / 2, class: "empty", "text-anchor": "middle" },
      "no engine steps yet: send a request"));
  } else {
    root.append(svg("text", { x: x0, y: height - 3, class: "axis" }, `step ${steps[0].index}`));
    root.append(svg("text", { x: width - 2, y: height - 3, class: "axis", "text-anchor": "end" },
      `step ${steps.at(-1).index}`));
  }
  container.replaceChildren(root);
  container.dataset.steps = String(steps.length);
  container.dataset.maxRunning = String(Math.max(0, ...steps.map((s) => s.num_running)));
}

function total(step) {
  const sum = (positions) => Object.values(positions).reduce((a, b) => a + b, 0);
  return sum(step.prefill) + sum(step.decode);
}

export function describeStep(step) {
  const sum = (positions) => Object.values(positions).reduce((a, b) => a + b, 0);
  const prefill = sum(step.prefill), decode = sum(step.decode);
  const engine = step.engine ? `engine ${step.engine} ` : "";
  return `${engine}step ${step.index}: ${prefill + decode} positions (prefill ${prefill} over ${Object.keys(step.prefill).length}` +
    ` requests, decode ${decode}), ${fmtMs(step.duration_s, 1)} (forward ${fmtMs(step.forward_s, 1)}), ` +
    `${step.num_running} running, ${step.num_waiting} waiting` +
    (step.draft_tokens ? `, drafts ${step.draft_tokens} verified, ${step.accepted_tokens} accepted` : "") +
    (step.preempted.length ? `, preempted ${step.preempted.join(", ")}` : "");
}

function hatchPattern() {
  const defs = svg("defs");
  const pattern = svg("pattern", { id: "hatch", patternUnits: "userSpaceOnUse", width: 5, height: 5,
    patternTransform: "rotate(45)" });
  pattern.append(svg("rect", { width: 2, height: 5, fill: "rgba(255,255,255,0.55)" }));
  defs.append(pattern);
  return defs;
}
