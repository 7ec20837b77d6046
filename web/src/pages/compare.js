// Several runs, several metrics overlaid (one chart per metric, ?metrics=a,b; ?metric=a
// too): jobs picked in the table (?jobs=a,b,c) or every trial of a sweep (?sweep=ID). Each is named by its name and the parameters in which the runs
// differ. Live while any run is: the jobs stream names the runs that changed, and the
// page re-reads those rows and the charts (at most every 2 s).
import { api, jobPath, query, stream } from "../api.js";
import { MetricChart, color, dash, swatch } from "../chart.js";
import { fmtNum, h, link, replace, stateBadge, throttle } from "../dom.js";
import { JOB_TERMINAL as TERMINAL } from "../states.gen.js";

const MAX_IDS = 100; // a changes event names at most this many jobs (api/ui_feed.py)
const MAX_METRICS = 8; // charts on one page

function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
    else out[key] = JSON.stringify(v);
  }
  return out;
}

const MAX_VALUE_CHARS = 24;

function parse(json) {
  try { return JSON.parse(json); } catch { return json; }
}

// One parameter's value, short: a non-integer rounded to `digits` significant digits, a
// sha256 (a code bundle) to its first 8 characters, anything long cut with "…".
export function shortValue(json, digits = 4) {
  const short = (v) => {
    if (typeof v === "number") return Number.isInteger(v) || !Number.isFinite(v) ? v : Number(v.toPrecision(digits));
    if (typeof v === "string") return /^[0-9a-f]{64}$/.test(v) ? v.slice(0, 8) : v;
    if (Array.isArray(v)) return v.map(short);
    if (v && typeof v === "object") return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, short(x)]));
    return v;
  };
  if (json == null) return "–";
  const v = short(parse(json));
  const text = typeof v === "string" ? v : JSON.stringify(v);
  return text.length > MAX_VALUE_CHARS ? text.slice(0, MAX_VALUE_CHARS - 1) + "…" : text;
}

// For each run, the parameters whose values are not the same in every run: `short`, as
// "key=value" with short values (numbers to 4 significant digits, or as many as keep
// the runs' values apart), and `full`, with the values as they are.
export function differences(params) {
  const keys = new Set(params.flatMap((p) => Object.keys(p)));
  const differing = [...keys].filter((k) => new Set(params.map((p) => p[k] ?? "∅")).size > 1).sort();
  const shown = new Map(differing.map((k) => {
    const raw = params.map((p) => p[k]);
    const distinct = new Set(raw.map((v) => v ?? "∅")).size;
    let digits = 4;
    while (digits < 17 && new Set(raw.map((v) => shortValue(v, digits))).size < distinct) digits++;
    return [k, raw.map((v) => shortValue(v, digits))];
  }));
  return params.map((p, i) => ({
    short: differing.map((k) => `${k}=${shown.get(k)[i]}`),
    full: differing.map((k) => `${k}=${p[k] ?? "–"}`),
  }));
}

export async function comparePage(root, { search, navigate }) {
  const ids = (search.get("jobs") || "").split(",").filter((x) => /^[0-9a-f]{1,64}$/.test(x));
  const sweep = search.get("sweep");
  let runs = []; // {id, name, params (flat, JSON values), job}
  let s = null; // the sweep, when its trials are compared
  if (sweep) {
    s = await api(`/v1/sweeps/${encodeURIComponent(sweep)}`);
    runs = s.trials.filter((t) => t.job_id).map((t) => ({ id: t.job_id, params: Object.fromEntries(Object.entries(t.params).map(([k, v]) => [k, JSON.stringify(v)])) }));
  } else {
    runs = ids.map((id) => ({ id, params: null }));
  }
  if (runs.length < 1) {
    replace(root, h("h2", {}, "Compare runs"), h("p", { class: "muted" }, "Pick two or more jobs in the ", link("/", "jobs table"), " and press Compare."));
    return null;
  }
  const missing = [];
  await Promise.all(runs.map(async (r) => {
    try { r.job = await api(jobPath(r.id)); } catch (e) { if (e.status === 404) missing.push(r.id); else throw e; }
  }));
  runs = runs.filter((r) => r.job);
  for (const r of runs) {
    r.name = r.job.name;
    if (!r.params) { const { name, ...rest } = r.job.spec; r.params = flatten(rest); }
  }
  const diffs = differences(runs.map((r) => r.params));
  runs.forEach((r, i) => {
    r.label = diffs[i].short.length ? `${r.name} · ${diffs[i].short.join(", ")}` : r.name;
    r.title = diffs[i].full.length ? `${r.name} · ${diffs[i].full.join(", ")}` : r.name;
  });
  const names = [...new Set(runs.flatMap((r) => Object.keys(r.job.latest_metrics)))].sort();
  const wanted = (search.get("metrics") || search.get("metric") || "").split(",").filter((n) => names.includes(n));
  const fallback = ["val/accuracy", "val/loss", "train/loss"].find((n) => names.includes(n)) || names[0];
  const metrics = [...new Set(wanted)].slice(0, MAX_METRICS);
  if (!metrics.length && fallback) metrics.push(fallback);
  const choose = (chosen) => {
    const m = names.filter((n) => chosen.includes(n)).join(",");
    navigate("/compare" + query(sweep ? { sweep, metrics: m } : { jobs: runs.map((r) => r.id).join(","), metrics: m }));
  };
  const picker = h("div", { id: "metrics", class: "compare-metrics" }, names.map((n) => h("label", { class: "col-choice" },
    h("input", { type: "checkbox", checked: metrics.includes(n), disabled: metrics.includes(n) ? metrics.length === 1 : metrics.length >= MAX_METRICS, dataset: { metric: n },
      onchange: (e) => choose(e.target.checked ? [...metrics, n] : metrics.filter((x) => x !== n)) }), " ", n)));
  const chartEls = metrics.map((m, i) => h("div", { class: "chart compare-chart", id: i === 0 ? "compare-chart" : null, dataset: { metric: m } }));
  const row = (r, i) => {
    // The run's last point (its final value), never the curve's best: for a sweep's
    // complete trials it is their `value`, so the largest here is the sweep's best.
    const last = (m) => r.job.latest_metrics[m];
    return h("tr", { dataset: { id: r.id } }, h("td", {}, swatch(color(i), dash(i))), h("td", {}, link(`/jobs/${r.id}`, r.name)), h("td", {}, stateBadge(r.job.state)),
      h("td", { class: "small mono differs", title: diffs[i].full.join(", ") || null }, diffs[i].short.join(", ") || "–"),
      metrics.map((m) => h("td", { class: "num", dataset: { metric: m } }, fmtNum(last(m) && last(m).value))));
  };
  const tbody = h("tbody", {}, runs.map(row));
  replace(root,
    h("div", { class: "toolbar" }, h("h2", {}, s ? ["Sweep ", link(`/sweeps/${s.id}`, s.name)] : `${runs.length} runs`), h("span", { class: "small" }, "metrics "), picker),
    missing.length ? h("p", { class: "error" }, `Not found: ${missing.join(", ")}`) : null,
    metrics.length ? h("div", { class: "charts" }, chartEls) : h("p", { class: "muted", id: "compare-chart" }, "These runs have no metrics yet."),
    h("table", { id: "runs" },
      h("thead", {}, h("tr", {}, ["", "run", "state", "differs in", ...metrics].map((t) => h("th", {}, t)))),
      tbody));
  if (!metrics.length) return null;
  const charts = metrics.map((m, k) => new MetricChart(chartEls[k], { title: m, sources: runs.map((r, i) => ({ job: r.id, name: m, label: r.label, title: r.title, color: color(i), dash: dash(i) })) }));
  const loadAll = () => Promise.all(charts.map((c) => c.load()));
  await loadAll();
  const stop = followRuns(runs, async (ids) => {
    await Promise.all(ids.map(async (id) => {
      const i = runs.findIndex((r) => r.id === id);
      runs[i].job = await api(jobPath(id));
      tbody.children[i].replaceWith(row(runs[i], i));
    }));
    await loadAll();
  });
  return () => { stop(); for (const c of charts) c.destroy(); };
}

// Calls `refresh(ids)` (at most every 2 s) with the runs that changed, until none is live.
function followRuns(runs, refresh) {
  const live = new Set(runs.filter((r) => !TERMINAL.has(r.job.state)).map((r) => r.id));
  if (!live.size) return () => {};
  const changed = new Set();
  let es = null;
  const soon = throttle(() => {
    const ids = [...changed];
    changed.clear();
    refresh(ids).then(() => {
      for (const r of runs) if (TERMINAL.has(r.job.state)) live.delete(r.id);
      if (!live.size && es) { es.close(); es = null; }
    }).catch(() => {});
  }, 2000);
  es = stream("/v1/ui/jobs/changes", {
    changes: ({ jobs }) => {
      // A full event may have left some out: then any live run may have changed.
      for (const id of jobs.length >= MAX_IDS ? live : jobs) if (live.has(id)) changed.add(id);
      if (changed.size) soon();
    },
  });
  return () => { if (es) es.close(); soon.cancel(); };
}
