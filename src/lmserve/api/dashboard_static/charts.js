// Small canvas time-series charts that scroll over the last few minutes, and shared formatting helpers.

export const WINDOW_S = 180;

export function fmtMs(seconds, digits = 1) {
  if (seconds == null) return "–";
  const ms = seconds * 1000;
  return ms >= 10000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(digits)} ms`;
}

export function fmtNum(value, digits = 0) {
  if (value == null || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

// A stable color per request id, so one request can be followed across the step view.
export function requestHue(id) {
  let hash = 0;
  for (const ch of id) hash = (hash * 31 + ch.charCodeAt(0)) | 0;
  return Math.abs(hash) % 360;
}

// The smallest 1, 2 or 5 times a power of ten that is at least `value` (no 2.5: its labels need more digits).
function niceCeil(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((s) => s * power).find((v) => v >= value * (1 - 1e-9));
}

// Gridlines at round values: about four of them, at whole numbers for counts.
export function axisScale(max, integer = false) {
  if (!(max > 0)) max = 1; // an empty chart still gets a readable 0–1 axis
  let step = niceCeil(max / 4);
  if (integer) step = Math.max(1, step);
  const top = Math.max(step, Math.ceil(max / step - 1e-9) * step);
  const digits = Math.max(0, Math.ceil(-Math.log10(step) - 1e-9));
  return { step, top, digits };
}

function cssVar(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

// series: [{label, color}]; kind: "line" | "area" (stacked) | "bars" (stacked columns, one per point).
export class TimeChart {
  constructor(canvas, legend, { series, kind = "line", digits = 0, integer = false }) {
    this.canvas = canvas;
    this.legend = legend;
    this.series = series;
    this.kind = kind;
    this.digits = digits;
    this.integer = integer;
    this.points = []; // [time_unix, [values...]]
    this.renderLegend();
  }

  push(time, values) {
    this.points.push([time, values]);
  }

  // Keeps what the window shows (plus a margin, so lines enter from the left edge).
  trim(now) {
    const oldest = now - WINDOW_S - 5;
    let drop = 0;
    while (drop < this.points.length && this.points[drop][0] < oldest) drop++;
    if (drop) this.points.splice(0, drop);
  }

  renderLegend() {
    const last = this.points.at(-1)?.[1];
    this.legend.replaceChildren(...this.series.map((s, i) => {
      const item = document.createElement("span");
      item.innerHTML = `<i style="background:${s.color}"></i>${s.label} `;
      const value = document.createElement("b");
      value.textContent = last ? fmtNum(last[i], this.digits) : "–";
      item.append(value);
      return item;
    }));
  }

  draw(now) {
    this.trim(now);
    this.renderLegend();
    const { canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    const left = 40, right = 6, top = 6, bottom = 16;
    const plotW = width - left - right, plotH = height - top - bottom;
    const visible = this.points.filter(([t]) => t >= now - WINDOW_S - 5);
    const stacked = this.kind !== "line";
    const total = (values) => (stacked ? values.reduce((a, b) => a + b, 0) : Math.max(...values));
    const scale = axisScale(Math.max(0, ...visible.map(([, v]) => total(v))), this.integer);
    const yMax = scale.top;
    const x = (t) => left + plotW * (1 - (now - t) / WINDOW_S);
    const y = (v) => top + plotH * (1 - v / yMax);

    this.drawAxes(ctx, { left, top, plotW, plotH, scale, y });
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, plotW, plotH);
    ctx.clip();
    if (this.kind === "bars") this.drawBars(ctx, visible, x, y);
    else if (this.kind === "area") this.drawAreas(ctx, visible, x, y);
    else this.drawLines(ctx, visible, x, y);
    ctx.restore();
  }

  drawAxes(ctx, { left, top, plotW, plotH, scale, y }) {
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = cssVar("--muted", "#777");
    ctx.strokeStyle = cssVar("--grid", "#e5e7eb");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let value = 0; value <= scale.top + 1e-9; value += scale.step) {
      const py = Math.round(y(value)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(left, py);
      ctx.lineTo(left + plotW, py);
      ctx.stroke();
      ctx.fillText(fmtNum(value, scale.digits), left - 4, py);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let ago = 0; ago <= WINDOW_S; ago += 60) {
      const px = left + plotW * (1 - ago / WINDOW_S);
      ctx.fillText(ago ? `-${ago / 60}m` : "now", Math.min(Math.max(px, left + 10), left + plotW - 12), top + plotH + 3);
    }
  }

  drawLines(ctx, points, x, y) {
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      points.forEach(([t, v], j) => (j ? ctx.lineTo(x(t), y(v[i])) : ctx.moveTo(x(t), y(v[i]))));
      ctx.stroke();
    });
  }

  drawAreas(ctx, points, x, y) {
    if (!points.length) return;
    const base = points.map(() => 0);
    this.series.forEach((s, i) => {
      const upper = points.map(([, v], j) => base[j] + v[i]);
      ctx.fillStyle = s.color;
      ctx.beginPath();
      points.forEach(([t], j) => (j ? ctx.lineTo(x(t), y(upper[j])) : ctx.moveTo(x(t), y(upper[j]))));
      for (let j = points.length - 1; j >= 0; j--) ctx.lineTo(x(points[j][0]), y(base[j]));
      ctx.closePath();
      ctx.fill();
      upper.forEach((u, j) => (base[j] = u));
    });
  }

  drawBars(ctx, points, x, y) {
    for (const [t, values] of points) {
      let bottom = 0;
      values.forEach((value, i) => {
        if (!value) return;
        ctx.fillStyle = this.series[i].color;
        ctx.fillRect(x(t) - 1, y(bottom + value), 2, y(bottom) - y(bottom + value));
        bottom += value;
      });
    }
  }
}
