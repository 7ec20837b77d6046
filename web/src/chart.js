// One chart of one or more curves, drawn from the server's downsampled series: each curve
// is its buckets' last values with the min–max band around them, so a spike inside a
// bucket still shows, at every zoom. Drag to zoom loads that step range's finer points
// from the server; double-click goes back to the whole run. Live points are appended.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { api, jobPath, query } from "./api.js";
import { fmtNum, h, replace, throttle } from "./dom.js";

// Twelve colours told apart on white; past twelve curves they come again dashed, then
// dotted, then dash-dotted (48 distinct curves before any repeats).
export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
  "#db2777", "#854d0e", "#65a30d", "#475569", "#ca8a04", "#1e1b4b"];
const DASHES = [null, [8, 4], [2, 3], [10, 3, 2, 3]];
const HEIGHT = 260;
const MAX_POINTS = 4000;
const STEP_INCRS = [1, 2, 5].flatMap((m) => Array.from({ length: 16 }, (_, e) => m * 10 ** e)).sort((a, b) => a - b);
const LOG_LABEL_GAP = 18; // px between labels on a log axis (12px text)

export function color(i) { return PALETTE[i % PALETTE.length]; }
export function dash(i) { return DASHES[Math.floor(i / PALETTE.length) % DASHES.length]; }

// A curve's sample for a legend: its colour, dashed as its line is.
export function swatch(colour, pattern) {
  const el = h("span", { class: "swatch" });
  el.style.background = pattern
    ? `repeating-linear-gradient(90deg, ${colour} 0 ${pattern[0] / 2}px, transparent ${pattern[0] / 2}px ${(pattern[0] + pattern[1]) / 2}px)`
    : colour;
  return el;
}

// Labels of a linear axis's ticks (`splits`, `incr` apart): as few decimals as show every
// tick exactly, so neighbours never read the same (0.9998, 0.9999, 1.0000, not 1, 1, 0.9999);
// in exponent form when they are all ≥ 1e6 or < 1e-3 (`exp`; "always": whatever they are).
export function tickLabels(splits, incr, { exp = true } = {}) {
  const vals = splits.filter((v) => v != null && Number.isFinite(v));
  const mag = vals.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
  const tol = incr > 0 ? incr * 1e-6 : mag * 1e-12;
  const exact = (fmt) => vals.every((v) => Math.abs(Number(fmt(v)) - v) <= tol);
  const show = (fmt) => splits.map((v) => (v == null || !Number.isFinite(v) ? "" : fmt(v)));
  if (exp === "always" || (exp && mag > 0 && (mag >= 1e6 || mag < 1e-3))) {
    let p = 0;
    while (p < 15 && !exact((v) => v.toExponential(p))) p++;
    return show((v) => v.toExponential(p).replace("e+", "e"));
  }
  let d = 0;
  while (d < 15 && !exact((v) => v.toFixed(d))) d++;
  const f = new Intl.NumberFormat(undefined, { minimumFractionDigits: d, maximumFractionDigits: d });
  return show((v) => f.format(Object.is(v, -0) ? 0 : v));
}

// A log axis's tick (1, 2, … 9 times a power of ten) as a short number.
export function logTickLabel(v) {
  if (v == null || !Number.isFinite(v)) return "";
  const a = Math.abs(v);
  if (a >= 1e6 || (a > 0 && a < 1e-3)) return String(Number(v.toPrecision(6)).toExponential()).replace("e+", "e");
  return String(Number(v.toPrecision(6)));
}

// Which of a log axis's ticks get a number: powers of ten first, then 5s, 2s and the rest,
// each where it keeps LOG_LABEL_GAP from those already labelled (uPlot's own choice
// labels whole decades only, which leaves a narrow range without any number).
function logLabelled(u, splits, axisIdx) {
  const scale = u.axes[axisIdx].scale;
  const pos = splits.map((v) => u.valToPos(v, scale));
  const rank = (v) => ({ 1: 0, 5: 1, 2: 2 })[v.toExponential()[v < 0 ? 1 : 0]] ?? 3;
  const order = splits.map((v, i) => i).sort((a, b) => rank(splits[a]) - rank(splits[b]) || a - b);
  const kept = [];
  for (const i of order) if (kept.every((k) => Math.abs(pos[k] - pos[i]) >= LOG_LABEL_GAP)) kept.push(i);
  const keep = new Set(kept);
  return splits.map((v, i) => (keep.has(i) ? v : null));
}

// The width a y axis needs for its labels (12px system-ui digits are about 7px wide).
function axisSize(u, values) {
  const longest = (values || []).reduce((n, v) => Math.max(n, String(v ?? "").length), 0);
  return Math.max(40, 19 + Math.ceil(longest * 7));
}

// The room between x ticks: the widest step label ("1,000,000") and a gap.
function stepSpace(u, axisIdx, min, max) {
  const widest = Math.max(Math.abs(min || 0), Math.abs(max || 0));
  const chars = Math.round(widest).toLocaleString().length;
  return Math.max(40, chars * 7 + 24);
}

function rgba(hex, a) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16},${(n >> 8) & 255},${n & 255},${a})`;
}

function finite(v) { return v == null || !Number.isFinite(v) ? null : v; }

function normalize(s) {
  if (!s) return { steps: [], values: [], min: [], max: [] };
  const values = s.values.map(finite);
  return { steps: s.steps, values, min: (s.min || s.values).map(finite), max: (s.max || s.values).map(finite) };
}

export class MetricChart {
  // sources: [{job, name, label, color, dash?, title?, width?, alpha?}]; one curve (with
  // its band) each; `title`: the full label, where `label` is a short one; `width` (px)
  // and `alpha` (0–1) set one curve apart: a sweep's best trial, its pruned ones.
  // `time`: the steps are Unix seconds (the worker's system series), drawn on a time axis;
  // `format`: how a value reads in the legend and on the y axis (default: fmtNum).
  // A source with `core: false` (a sweep's pruned or failed trial) is an outlier: the y
  // range covers the others' values unless "include outliers" is ticked (`outliers`).
  constructor(el, { title, sources, time = false, format = null, outliers = false }) {
    this.el = el;
    this.sources = sources;
    this.time = time;
    this.format = format;
    this.overview = sources.map(() => normalize(null));
    this.zoomed = null;
    this.range = null;
    this.log = false;
    this.appended = 0;
    this.loads = 0;
    this.u = null;
    el.__chart = this; // for tests and the benchmark
    el.dataset.mode = "overview";
    this.logBox = h("input", { type: "checkbox", onchange: () => this.setLog(this.logBox.checked) });
    this.stepEl = h("span", { class: "muted small" });
    this.outliersBox = sources.some((s) => s.core === false)
      ? h("input", { type: "checkbox", id: "outliers", checked: outliers, onchange: () => { if (this.u) this.u.setData(this.u.data); } })
      : null;
    this.plotEl = h("div", { class: "plot" });
    this.legendEl = h("div", { class: "legend" });
    replace(el,
      h("div", { class: "chart-head" },
        h("h3", {}, title),
        h("label", { class: "small" }, this.logBox, " log scale"),
        this.outliersBox ? h("label", { class: "small", title: "the y range covers the complete and running trials; ticked, every curve" }, this.outliersBox, " include outliers") : null,
        h("span", { class: "muted small hint" }, "drag to zoom · double-click to reset"),
        this.stepEl),
      this.plotEl, this.legendEl);
    this.legendValues = sources.map((s) => h("span", { class: "legend-value" }));
    replace(this.legendEl, sources.map((s, i) => h("span", { class: s.alpha < 1 ? "legend-item dim" : "legend-item", title: s.title || s.label },
      swatch(s.color, s.dash), h("span", { class: "legend-label" }, s.label), this.legendValues[i])));
    this.redraw = throttle(() => this.draw(), 250);
    this.reloadSoon = throttle(() => this.load().catch(() => {}), 3000);
    this.resizer = new ResizeObserver(() => this.u && this.u.setSize({ width: this.width(), height: HEIGHT }));
    this.resizer.observe(this.plotEl);
  }

  width() { return Math.max(300, Math.floor(this.plotEl.clientWidth || 600)); }

  async fetch(range) {
    const byJob = new Map();
    this.sources.forEach((s, i) => { if (!byJob.has(s.job)) byJob.set(s.job, []); byJob.get(s.job).push(i); });
    const maxPoints = Math.min(MAX_POINTS, this.width());
    const out = [];
    await Promise.all([...byJob].map(async ([job, idxs]) => {
      const params = { name: idxs.map((i) => this.sources[i].name), max_points: maxPoints };
      if (range) Object.assign(params, { min_step: range[0], max_step: range[1] });
      const body = await api(jobPath(job) + "/metrics" + query(params));
      for (const i of idxs) out[i] = normalize(body.series[this.sources[i].name]);
    }));
    return out;
  }

  async load() {
    this.overview = await this.fetch(null);
    this.appended = 0;
    this.loads += 1;
    this.el.dataset.loads = String(this.loads);
    if (!this.zoomed) this.draw();
  }

  async zoom(lo, hi) {
    this.range = [lo, hi];
    this.el.dataset.mode = "loading";
    const data = await this.fetch([lo, hi]);
    if (!this.range || this.range[0] !== lo || this.range[1] !== hi) return; // superseded
    this.zoomed = data;
    this.draw();
    this.el.dataset.range = `${lo}-${hi}`;
    this.el.dataset.mode = "zoom";
  }

  reset() {
    this.zoomed = null;
    this.range = null;
    this.el.dataset.mode = "overview";
    delete this.el.dataset.range;
    this.draw();
  }

  // A live point (from the job's event stream).
  append(job, name, step, value) {
    const i = this.sources.findIndex((s) => s.job === job && s.name === name);
    if (i < 0) return false;
    const o = this.overview[i];
    if (o.steps.length && step <= o.steps[o.steps.length - 1]) return true; // already drawn
    const v = finite(value);
    o.steps.push(step); o.values.push(v); o.min.push(v); o.max.push(v);
    this.appended += 1;
    // Appended points are raw: past a screenful, ask for buckets again.
    if (this.appended > this.width()) this.reloadSoon();
    if (!this.zoomed) this.redraw();
    return true;
  }

  setLog(on) {
    this.log = on;
    if (this.u) { this.u.destroy(); this.u = null; }
    this.draw();
  }

  data() {
    const parts = this.zoomed || this.overview;
    const tables = parts.map((p) => [p.steps, p.values, p.min, p.max]);
    return tables.length === 1 ? tables[0] : uPlot.join(tables);
  }

  draw() {
    const data = this.data();
    const positive = data.slice(1).every((ys) => ys.every((v) => v == null || v > 0));
    this.logBox.disabled = !positive;
    this.logBox.title = positive ? "" : "values ≤ 0 have no logarithm";
    if (this.log && !positive) { this.log = false; this.logBox.checked = false; if (this.u) { this.u.destroy(); this.u = null; } }
    if (this.u) this.u.setData(data);
    else this.u = new uPlot(this.options(), data, this.plotEl);
    this.el.dataset.points = String(data[0].length);
    this.showValues(null);
    if (data[0].length && !this.el.dataset.ready) {
      this.el.dataset.ready = "1";
      performance.mark("ty-first-chart");
    }
  }

  options() {
    const series = [{ label: this.time ? "time" : "step" }];
    const bands = [];
    this.sources.forEach((s, i) => {
      const base = 1 + 3 * i;
      const a = s.alpha ?? 1; // a dimmed curve (a pruned trial) is drawn see-through
      series.push({ label: s.label, stroke: a < 1 ? rgba(s.color, a) : s.color, width: s.width || 1.5, spanGaps: true, ...(s.dash ? { dash: s.dash } : {}) });
      for (const edge of ["min", "max"]) {
        series.push({ label: `${s.label} ${edge}`, stroke: rgba(s.color, 0.45 * a), width: 1, spanGaps: true, points: { show: false } });
      }
      bands.push({ series: [base + 2, base + 1], fill: rgba(s.color, 0.15 * a) });
    });
    return {
      width: this.width(),
      height: HEIGHT,
      series,
      bands,
      legend: { show: false },
      scales: { x: { time: this.time }, y: { ...(this.log ? { distr: 3, log: 10 } : { distr: 1 }), ...(this.outliersBox ? { range: (u, lo, hi) => this.yRange(u, lo, hi) } : {}) } },
      axes: [
        // Steps are whole numbers: so are the x ticks. Times: uPlot's own time axis.
        this.time ? {} : { incrs: STEP_INCRS, space: stepSpace, values: (u, splits, i, space, incr) => tickLabels(splits, incr, { exp: false }) },
        this.log
          ? { size: axisSize, filter: logLabelled, values: (u, splits) => splits.map(logTickLabel) }
          : { size: axisSize, values: (u, splits, i, space, incr) => (this.format ? splits.map(this.format) : tickLabels(splits, incr)) },
      ],
      cursor: {
        drag: { x: true, y: false, setScale: false },
        bind: { dblclick: () => () => { this.reset(); return null; } },
      },
      hooks: {
        setSelect: [(u) => this.onSelect(u)],
        setCursor: [(u) => this.showValues(u.cursor.idx)],
      },
    };
  }

  // The y range: uPlot's own over every curve, or (outliers left out) over the core
  // sources' values and bands only, when they have any.
  yRange(u, lo, hi) {
    let a = Infinity, b = -Infinity;
    if (this.outliersBox && !this.outliersBox.checked) {
      this.sources.forEach((s, i) => {
        if (s.core === false) return;
        for (const ys of u.data.slice(1 + 3 * i, 4 + 3 * i)) for (const v of ys || []) if (v != null && (!this.log || v > 0)) { a = Math.min(a, v); b = Math.max(b, v); }
      });
    }
    if (!(a <= b)) [a, b] = [lo, hi];
    if (a == null || b == null) return [a, b];
    return this.log ? uPlot.rangeLog(a, b, 10, true) : uPlot.rangeNum(a, b, 0.1, true);
  }

  onSelect(u) {
    const { left, width } = u.select;
    if (width < 3) return;
    const lo = Math.floor(u.posToVal(left, "x"));
    const hi = Math.ceil(u.posToVal(left + width, "x"));
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    if (hi > lo) this.zoom(lo, hi).catch((e) => { this.el.dataset.mode = "error"; this.stepEl.textContent = e.message; });
  }

  // The legend's values: under the cursor, else each curve's last point.
  showValues(idx) {
    const data = this.u ? this.u.data : this.data();
    const xs = data[0];
    const at = (x) => (this.time ? new Date(x * 1000).toLocaleString() : `step ${x}`);
    this.stepEl.textContent = idx != null && xs[idx] != null ? at(xs[idx]) : "";
    this.sources.forEach((s, i) => {
      const ys = data[1 + 3 * i] || [];
      let k = idx;
      if (k == null) { k = ys.length - 1; while (k >= 0 && ys[k] == null) k--; }
      this.legendValues[i].textContent = k != null && k >= 0 ? (this.format || fmtNum)(ys[k]) : "–";
    });
  }

  destroy() {
    this.resizer.disconnect();
    this.redraw.cancel();
    this.reloadSoon.cancel();
    if (this.u) this.u.destroy();
    this.u = null;
  }
}

// Metric names to charts: curves that share what follows their first "/" share a chart
// (train/loss with val/loss), everything else has its own.
export function metricGroups(names) {
  const groups = new Map();
  for (const name of [...names].sort()) {
    const key = name.includes("/") ? name.slice(name.indexOf("/") + 1) : name;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(name);
  }
  return [...groups].map(([title, members]) => ({ title, names: members }));
}
