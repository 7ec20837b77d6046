// A sweep's parallel coordinates, as SVG: one vertical axis per parameter (its range from
// the sweep's space: log-scaled for `log: true`, one position per choice for a categorical)
// and one for the objective, one polyline per trial that has a value, coloured by how good
// that value is. Pruned trials are dashed and faint, the best is drawn last and thick.
// Presentation attributes only (no style attributes): the page's CSP allows no inline style.
import { tickLabels } from "./chart.js";
import { fmtNum } from "./dom.js";

const NS = "http://www.w3.org/2000/svg";
const HEIGHT = 340;
const PAD = { top: 44, bottom: 30, left: 80, right: 80 };
const CHAR_PX = 6.6; // an 11px system-ui character, about
const MIN_GAP = 13; // px between tick labels (11px text)
// Worse to better: orange, purple, deep blue (every one readable on white).
const STOPS = [[249, 115, 22], [168, 85, 247], [29, 78, 216]];

export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v != null && v !== false) el.setAttribute(k, String(v));
  for (const c of children.flat()) if (c != null && c !== false) el.append(c instanceof Node ? c : String(c));
  return el;
}

// Goodness 0 (worst) .. 1 (best) as a colour between the stops.
export function goodColour(g) {
  const x = Math.min(1, Math.max(0, g)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  const c = STOPS[i].map((v, k) => Math.round(v + (STOPS[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
}

function linearTicks(lo, hi, integer) {
  if (!(hi > lo)) return [lo];
  let step = niceStep(hi - lo, 4);
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function logTicks(lo, hi) {
  const out = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    for (const m of [1, 2, 5]) {
      const v = Number((m * 10 ** e).toPrecision(12));
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) out.push({ v, major: m === 1 });
    }
  }
  const shown = out.length > 7 ? out.filter((t) => t.major) : out;
  return shown.length >= 2 ? shown.map((t) => t.v) : [lo, hi];
}

// An axis' tick labels in one notation: scientific when any tick is below 1e-3 or from 1e6
// (1e-5, 1e-4, 1e-3, never 1.000e-5 beside 0.01), else fixed; as few digits as show each
// tick exactly (a linear axis' ticks with the same decimals, 0.025 and 0.050).
function tickTexts(values, log) {
  const sci = values.some((v) => v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6));
  if (log && !sci) return values.map(String); // 0.001, 0.01, 0.1
  const labels = tickLabels(values, 0, { exp: sci ? "always" : false });
  return sci ? labels.map((t, i) => (values[i] === 0 ? "0" : t)) : labels; // not 0e0
}

function jsonKey(v) { return JSON.stringify(v); }

// One axis: where a value sits (0 bottom .. 1 top, null when off the axis) and its ticks.
export function makeAxis(name, p, values, short) {
  if (p && p.type === "categorical") {
    const keys = p.choices.map(jsonKey);
    const n = keys.length;
    const pos = (v) => { const i = keys.indexOf(jsonKey(v)); return i < 0 ? null : n === 1 ? 0.5 : i / (n - 1); };
    return { name, kind: "categorical", pos, ticks: p.choices.map((c) => ({ at: pos(c), label: short(jsonKey(c)) })) };
  }
  const nums = values.filter((v) => typeof v === "number" && Number.isFinite(v));
  let lo = p && p.low != null ? p.low : Math.min(...nums);
  let hi = p && p.high != null ? p.high : Math.max(...nums);
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) { lo = 0; hi = 1; }
  const log = !!(p && p.log) && lo > 0;
  const f = log ? Math.log10 : (v) => v;
  const span = f(hi) - f(lo);
  const pos = (v) => (typeof v !== "number" || !Number.isFinite(v) || (log && v <= 0) ? null
    : span > 0 ? Math.min(1, Math.max(0, (f(v) - f(lo)) / span)) : 0.5);
  const values_ = log ? logTicks(lo, hi) : linearTicks(lo, hi, p && p.type === "int");
  const labels = tickTexts(values_, log);
  return { name, kind: log ? "log" : "linear", pos, ticks: values_.map((v, i) => ({ at: pos(v), label: labels[i] })) };
}

function clip(text, px) {
  const max = Math.max(3, Math.floor(px / CHAR_PX));
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

// Ticks at least MIN_GAP px apart (of 100 choices, every few), first and last kept first.
function spaced(ticks, plotH) {
  const order = ticks.map((t, i) => i).sort((a, b) => (b === ticks.length - 1) - (a === ticks.length - 1) || a - b);
  const kept = [];
  for (const i of order) if (kept.every((k) => Math.abs(ticks[k].at - ticks[i].at) * plotH >= MIN_GAP)) kept.push(i);
  return kept.sort((a, b) => a - b).map((i) => ticks[i]);
}

// `room`: the width its name may take, centred on the axis.
function drawAxis(axis, x, plotH, room) {
  const y = (t) => PAD.top + (1 - t) * plotH;
  const ticks = spaced(axis.ticks.filter((t) => t.at != null), plotH).map((t) => svg("g", { class: "pc-tick" },
    svg("line", { x1: x - 4, x2: x, y1: y(t.at), y2: y(t.at), stroke: "#9ca3af" }),
    svg("text", { x: x - 6, y: y(t.at), "text-anchor": "end", "dominant-baseline": "middle" }, clip(t.label, PAD.left - 10))));
  const title = axis.title || axis.name;
  return svg("g", { class: `pc-axis pc-${axis.kind}`, "data-name": axis.name },
    svg("line", { x1: x, x2: x, y1: PAD.top, y2: PAD.top + plotH, stroke: "#6b7280" }),
    svg("text", { class: "pc-label", x, y: PAD.top - 24, "text-anchor": "middle" }, svg("title", {}, title), clip(title, room)),
    axis.sub ? svg("text", { class: "pc-sub", x, y: PAD.top - 10, "text-anchor": "middle" }, clip(axis.sub, room)) : null,
    ticks);
}

// A left-to-right gradient from worst to best, with the objective's worst and best values.
function colourKey(width, worst, best) {
  const stops = [0, 0.5, 1].map((o) => svg("stop", { offset: o, "stop-color": goodColour(o) }));
  const x = width / 2 - 80;
  const y = HEIGHT - 10;
  return svg("g", { class: "pc-key" },
    svg("defs", {}, svg("linearGradient", { id: "pc-good", x1: 0, x2: 1, y1: 0, y2: 0 }, stops)),
    svg("text", { x: x - 6, y, "text-anchor": "end", "dominant-baseline": "middle" }, `worse ${fmtNum(worst)}`),
    svg("rect", { x, y: y - 4, width: 160, height: 8, rx: 2, fill: "url(#pc-good)" }),
    svg("text", { x: x + 166, y, "dominant-baseline": "middle" }, `${fmtNum(best)} better`));
}

// opts: {params: [[name, spaceParam]], trials, objective: {metric, mode}, bestNumber, short}
export function parallelCoords(width, { params, trials, objective, bestNumber, short }) {
  const shown = trials.filter((t) => t.value != null && Number.isFinite(t.value));
  const values = shown.map((t) => t.value);
  const axes = params.map(([name, p]) => makeAxis(name, p, shown.map((t) => t.params[name]), short));
  const lo = Math.min(...values), hi = Math.max(...values);
  const obj = makeAxis(objective.metric, { type: "float", low: lo, high: hi }, values, short);
  obj.sub = objective.mode === "max" ? "higher is better" : "lower is better";
  axes.push(obj);
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const gap = (width - PAD.left - PAD.right) / Math.max(1, axes.length - 1);
  const xs = axes.map((a, i) => (axes.length === 1 ? width / 2 : PAD.left + i * gap));
  const good = (v) => (hi > lo ? (objective.mode === "max" ? (v - lo) / (hi - lo) : (hi - v) / (hi - lo)) : 1);
  // Worst first, the best last, so the best ones lie on top.
  const order = [...shown].sort((a, b) => good(a.value) - good(b.value) || (a.number === bestNumber) - (b.number === bestNumber));
  const lines = order.map((t) => {
    const pts = axes.map((a, i) => {
      const at = a === obj ? obj.pos(t.value) : a.pos(t.params[a.name]);
      return at == null ? null : `${xs[i].toFixed(1)},${(PAD.top + (1 - at) * plotH).toFixed(1)}`;
    });
    if (pts.includes(null)) return null;
    const best = t.number === bestNumber;
    const label = `#${t.number} ${t.status}${best ? " (best)" : ""}: ` + params.map(([n]) => `${n}=${short(jsonKey(t.params[n]))}`).join(", ") + ` → ${fmtNum(t.value)}`;
    return svg("polyline", {
      class: `pc-line${best ? " best" : ""}${t.pruned ? " pruned" : ""}`, points: pts.join(" "), fill: "none",
      stroke: goodColour(good(t.value)), "stroke-width": best ? 3.5 : 1.8, "stroke-opacity": t.pruned ? 0.4 : 0.9,
      "stroke-dasharray": t.pruned ? "5 4" : null, "data-number": t.number,
    }, svg("title", {}, label));
  }).filter(Boolean);
  return svg("svg", { class: "parcoords", width, height: HEIGHT, viewBox: `0 0 ${width} ${HEIGHT}`, role: "img", "aria-label": "parallel coordinates of the trials" },
    svg("g", { class: "pc-lines" }, lines),
    axes.map((a, i) => drawAxis(a, xs[i], plotH, Math.min(axes.length === 1 ? width : gap, 2 * xs[i], 2 * (width - xs[i])) - 8)),
    hi > lo ? colourKey(width, objective.mode === "max" ? lo : hi, objective.mode === "max" ? hi : lo) : null);
}
