// One sweep: its state and settings, Cancel (asks first), the trials' curves of the
// objective overlaid (the best thick, pruned ones faint), parallel coordinates, parameter
// importances and the trial table (the best and pruned trials marked). Every number shown
// for a trial is its `value` from GET /v1/sweeps/{id} (a complete trial's final value, a
// pruned one's at the rung that pruned it); the best is the sweep's `best`. Live while the
// sweep or any of its trials runs (followLive).
import { api, query } from "../api.js";
import { MetricChart, color, swatch } from "../chart.js";
import { confirmCancel as confirmCancelDialog, fmtNum, fmtTime, h, link, replace, stateBadge } from "../dom.js";
import { parallelCoords } from "../parcoords.js";
import { JOB, JOB_TERMINAL as TERMINAL } from "../states.gen.js";
import { shortValue } from "./compare.js";
import { countsCell, followLive, objectiveText } from "./sweeps.js";

const sweepPath = (id) => `/v1/sweeps/${encodeURIComponent(id)}`;
const short = (json) => shortValue(json);

function statusBadge(t, best) {
  // A paused trial (pruner halving) waits at a rung, its worker freed, for the others.
  const text = t.status === "paused" ? `paused at eval ${t.paused_at}` : t.status;
  const title = t.status === "paused" ? "waits at this rung until the trials still running reach it; then goes on from its checkpoint or is pruned" : null;
  return [h("span", { class: `status status-${t.status}`, title }, text), best ? h("span", { class: "badge-best", title: "the complete trial with the best value" }, "★ best") : null];
}

// The trial table: one column per parameter, the objective's value and the step it was at.
function trialTable(s, colours) {
  const names = Object.keys(s.space);
  const best = s.best ? s.best.number : null;
  const heads = ["", "#", "status", "job", "job state", ...names, s.objective.metric, "step"];
  const row = (t) => h("tr", { class: [t.number === best ? "best" : "", t.pruned ? "pruned" : ""].join(" ").trim() || null, dataset: { number: t.number, status: t.status } },
    h("td", {}, colours.has(t.number) ? swatch(colours.get(t.number)) : null),
    h("td", { class: "num" }, t.number),
    h("td", { class: "status-cell", title: t.error || null }, statusBadge(t, t.number === best), t.error ? h("div", { class: "small error-text trial-error" }, t.error) : null),
    h("td", { class: "mono small" }, t.job_id ? link(`/jobs/${t.job_id}`, t.job_id.slice(0, 12)) : "–"),
    h("td", {}, stateBadge(t.state)),
    names.map((n) => h("td", { class: "mono small param", title: JSON.stringify(t.params[n]) }, short(JSON.stringify(t.params[n])))),
    h("td", { class: "num value", title: t.value == null ? null : String(t.value), dataset: t.value == null ? {} : { value: String(t.value) } }, fmtNum(t.value)),
    h("td", { class: "num" }, t.step ?? "–"));
  return h("div", { class: "table-wrap" }, h("table", { id: "trials" },
    h("thead", {}, h("tr", {}, heads.map((x, i) => h("th", i >= 5 && i < 5 + names.length ? { class: "param-head", title: x } : {}, x)))),
    h("tbody", {}, s.trials.length ? s.trials.map(row) : h("tr", {}, h("td", { colspan: heads.length, class: "muted" }, "No trial yet.")))));
}

function importanceBars(body) {
  const entries = Object.entries(body.importances);
  if (!entries.length) return h("p", { class: "muted", id: "no-importances" }, `No importances yet: ${body.reason || "too few complete trials"}.`);
  return [
    h("div", { class: "imp-bars" }, entries.map(([name, f]) => {
      const fill = h("div", { class: "imp-fill" });
      fill.style.width = `${(100 * f).toFixed(1)}%`; // CSSOM: allowed where a style attribute is not
      return h("div", { class: "imp-row", dataset: { param: name, fraction: String(f) }, title: `${name}: ${(100 * f).toFixed(1)}%` },
        h("span", { class: "imp-name mono small" }, name), h("div", { class: "imp-bar" }, fill), h("span", { class: "imp-val num small" }, `${(100 * f).toFixed(1)}%`));
    })),
    h("p", { class: "muted small" }, `fANOVA over ${body.trials} complete trials: each parameter's share of the objective's variance.`),
  ];
}

function infoRows(s) {
  const best = s.best;
  return [
    ["owner", s.owner], ["objective", objectiveText(s.objective)],
    ["trials", countsCell(s)], ["parallel", String(s.parallel)],
    ["sampler", `${s.sampler}, pruner ${s.pruner}, seed ${s.seed}`],
    ["best", best ? h("span", { id: "best" }, h("strong", {}, fmtNum(best.value)), ` · trial #${best.number}`, best.job_id ? [" · ", link(`/jobs/${best.job_id}`, "job")] : null) : h("span", { class: "muted" }, "no complete trial yet")],
    s.error ? ["error", h("span", { class: "error-text" }, s.error)] : null,
    ["created", fmtTime(s.created_at)], ["finished", fmtTime(s.finished_at)],
  ].filter(Boolean);
}

// The trials whose values set the curves' y range unless "include outliers" is ticked.
const CORE = new Set(["complete", JOB.RUNNING, "paused"]);

// The curves' sources: one per trial with a job, coloured as in the table.
function curveSources(s) {
  const best = s.best ? s.best.number : null;
  return s.trials.filter((t) => t.job_id).map((t, i) => ({
    job: t.job_id, name: s.objective.metric, color: color(i), number: t.number,
    label: `#${t.number}${t.number === best ? " (best)" : t.pruned ? " (pruned)" : ""}`,
    title: `#${t.number} ${t.status}: ${Object.entries(t.params).map(([k, v]) => `${k}=${short(JSON.stringify(v))}`).join(", ")}`,
    width: t.number === best ? 3 : 1.5, alpha: t.pruned ? 0.35 : null, core: CORE.has(t.status),
  }));
}

export async function sweepPage(root, { params }) {
  const id = params[0];
  let s;
  try { s = await api(sweepPath(id)); } catch (e) {
    replace(root, h("h2", {}, "Sweep not found"), h("p", { class: "muted" }, e.status === 404 ? `No sweep ${id} that you can see.` : e.message), link("/sweeps", "All sweeps"));
    return null;
  }
  const parts = {
    head: h("section", { class: "job-head" }), info: h("section", { class: "info sweep-info" }),
    chart: h("div", { class: "chart", id: "trial-curves" }),
    importances: h("div", { class: "chart", id: "importances" }),
    parcoords: h("div", { class: "chart pc-wrap", id: "parcoords" }), trials: h("section", {}),
  };
  const dialog = h("dialog", { id: "confirm-cancel" });
  replace(root, parts.head, parts.info,
    h("div", { class: "sweep-grid" }, parts.chart, parts.importances),
    parts.parcoords, h("h2", {}, "Trials"), parts.trials, dialog);
  let chart = null, chartKey = null, impDone = null, closed = false, outliers = false;

  function renderHead() {
    const cancel = s.state === JOB.RUNNING ? h("button", { class: "danger", id: "cancel", onclick: confirmCancel }, "Cancel…") : null;
    replace(parts.head,
      h("div", {}, h("h1", { id: "sweep-name" }, s.name), h("div", { class: "muted mono small" }, s.id)),
      h("div", { class: "head-right" }, link(`/compare${query({ sweep: s.id, metric: s.objective.metric })}`, "Compare trials"), h("span", { id: "sweep-state" }, stateBadge(s.state)), cancel));
    replace(parts.info, h("dl", {}, infoRows(s).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])));
  }

  function renderChart() {
    const sources = curveSources(s);
    const key = JSON.stringify(sources.map((x) => [x.job, x.label, x.alpha, x.core]));
    if (key === chartKey && chart) return chart.load().catch(() => {});
    if (chart && chart.outliersBox) outliers = chart.outliersBox.checked;
    if (chart) chart.destroy();
    chart = null;
    chartKey = key;
    if (!sources.length) { replace(parts.chart, h("h3", {}, s.objective.metric), h("p", { class: "muted" }, "No trial has started yet.")); return null; }
    chart = new MetricChart(parts.chart, { title: `${s.objective.metric} of each trial`, sources, outliers });
    return chart.load().catch((e) => { parts.chart.dataset.error = e.message; });
  }

  function renderParcoords() {
    const width = Math.max(480, Math.floor(parts.parcoords.clientWidth - 26 || 900));
    const withValue = s.trials.filter((t) => t.value != null).length;
    const head = h("div", { class: "chart-head" }, h("h3", {}, "Parallel coordinates"),
      h("span", { class: "muted small" }, `${withValue} trial${withValue === 1 ? "" : "s"} with a value; colour: the objective; dashed: pruned`));
    if (!withValue) return replace(parts.parcoords, head, h("p", { class: "muted" }, "No trial has a value yet."));
    replace(parts.parcoords, head, parallelCoords(width, {
      params: Object.entries(s.space), trials: s.trials, objective: s.objective, bestNumber: s.best ? s.best.number : null, short,
    }));
  }

  async function renderImportances() {
    const complete = (s.counts && s.counts.complete) || 0;
    if (impDone === complete) return; // they change only with the complete trials
    const body = await api(sweepPath(id) + "/importances");
    impDone = complete;
    replace(parts.importances, h("div", { class: "chart-head" }, h("h3", {}, "Parameter importances")), importanceBars(body));
  }

  function render() {
    renderHead();
    const colours = new Map(curveSources(s).map((x) => [x.number, x.color]));
    replace(parts.trials, trialTable(s, colours));
    renderParcoords();
    root.dataset.state = s.state;
  }

  async function refresh() {
    s = await api(sweepPath(id));
    if (closed) return;
    render();
    await Promise.all([renderChart(), renderImportances().catch((e) => replace(parts.importances, h("p", { class: "error-text" }, e.message)))]);
    root.dataset.loads = String((parseInt(root.dataset.loads || "0", 10) || 0) + 1);
  }

  function confirmCancel() {
    confirmCancelDialog(dialog, {
      question: ["Cancel the sweep ", h("strong", {}, s.name), "? No new trial starts; queued trials are cancelled and running ones stop (their checkpoints are kept)."],
      label: "Cancel sweep", path: sweepPath(id) + "/cancel", errorsIn: parts.head,
      after: () => refresh().catch(() => {}), post: (path) => api(path, { method: "POST" }),
    });
  }

  render();
  await Promise.all([renderChart(), renderImportances().catch((e) => replace(parts.importances, h("p", { class: "error-text" }, e.message)))]);
  root.dataset.loads = "1";
  let seenWidth = parts.parcoords.clientWidth;
  const resizer = new ResizeObserver(() => {
    if (parts.parcoords.clientWidth === seenWidth) return; // only a new width redraws it
    seenWidth = parts.parcoords.clientWidth;
    renderParcoords();
  });
  resizer.observe(parts.parcoords);
  const live = () => s.state === JOB.RUNNING || s.trials.some((t) => t.status === JOB.RUNNING || !TERMINAL.has(t.state));
  const stop = followLive(refresh, live);
  return () => { closed = true; stop(); resizer.disconnect(); if (chart) chart.destroy(); };
}
