// The jobs table as a runs table: which metric and param columns show (the "columns"
// chooser), its order (a click on a column's head: the server sorts, so pages stay right)
// and filters on a metric's latest value, all kept in the page's URL (`metrics`, `params`,
// `sort`, `filter`), so a view is a link. Names are checked as the server checks them
// (api/routers/ui_jobs.py), and shown as text nodes only.
import { h, replace } from "./dom.js";

export const DEFAULT_METRICS = ["train/loss", "val/accuracy"];
export const MAX_METRICS = 8; // the server's MAX_METRIC_COLUMNS
export const MAX_FILTERS = 4;
export const OPS = { gt: ">", ge: "≥", lt: "<", le: "≤" };
const METRIC = /^[a-z0-9_./-]{1,100}$/;
const PARAM = /^[A-Za-z_][A-Za-z0-9_]{0,63}$/;

// A filter as the server takes it: metric:<name>:<gt|ge|lt|le>:<number>.
export function parseFilter(text) {
  const [kind, name, op, num] = text.split(":");
  const value = Number(num);
  if (kind !== "metric" || !METRIC.test(name || "") || !(op in OPS) || num === "" || !Number.isFinite(value)) return null;
  return { name, op, value };
}
export const filterText = (f) => `metric:${f.name}:${f.op}:${f.value}`;

// The view's columns from the URL: `metrics`/`params` null where not chosen (the default
// metrics; the most common params), [] where all were taken away ("," in the URL).
export function readColumns(search) {
  const list = (key, re) => (search.has(key) ? search.get(key).split(",").filter((n) => re.test(n)) : null);
  const sort = search.get("sort") || "";
  return {
    metrics: list("metrics", METRIC)?.slice(0, MAX_METRICS) ?? null,
    params: list("params", PARAM),
    sort: /^(created_at|metric:[a-z0-9_./-]{1,100}|param:[A-Za-z_][A-Za-z0-9_]{0,63})(:asc|:desc)?$/.test(sort) ? sort : "",
    filters: search.getAll("filter").map(parseFilter).filter(Boolean).slice(0, MAX_FILTERS),
  };
}

const listParam = (names) => (names == null ? null : names.join(",") || ",");

// The view's part of the page's own URL, and of GET /v1/ui/jobs.
export function columnsUrl(cols) {
  return { metrics: listParam(cols.metrics), params: listParam(cols.params), sort: cols.sort || null, filter: cols.filters.map(filterText) };
}
export function columnsQuery(cols) {
  return { metric: listParam(cols.metrics), sort: cols.sort || null, filter: cols.filters.map(filterText) };
}
export const metricColumns = (cols) => cols.metrics ?? DEFAULT_METRICS;

// Next order after a click on the head of `key` (metric:<name>, param:<name>, created_at):
// descending, then ascending, then the default (newest first).
export function nextSort(sort, key) {
  if (sort === `${key}:desc` || sort === key) return `${key}:asc`;
  if (sort === `${key}:asc`) return "";
  return `${key}:desc`;
}

// A column's head that sorts by `key` when clicked, marked ▼/▲ while it does.
export function sortHead(label, key, cols, onSort, props = {}) {
  const way = cols.sort === `${key}:asc` ? "asc" : cols.sort === `${key}:desc` || cols.sort === key ? "desc" : null;
  const cls = [props.class, "sortable", way ? "sorted" : null].filter(Boolean).join(" ");
  return h("th", { ...props, class: cls, dataset: { ...(props.dataset || {}), sort: key, way }, title: props.title || `sort by ${label}`, onclick: () => onSort(nextSort(cols.sort, key)) },
    label, way ? (way === "desc" ? " ▼" : " ▲") : null);
}

// The columns chooser: a checkbox per metric the page's jobs have and per param, the chosen
// ones first. `onChange({metrics, params})` with the new lists.
export function columnsPanel(panel, { cols, metricNames, paramNames, shownParams, onChange }) {
  const metrics = metricColumns(cols);
  const allMetrics = [...new Set([...metrics, ...metricNames])];
  const allParams = [...new Set([...shownParams, ...paramNames])];
  const box = (kind, name, on, list) => h("label", { class: "col-choice" },
    h("input", { type: "checkbox", checked: on, disabled: kind === "metric" && !on && list.length >= MAX_METRICS, dataset: { [kind]: name }, onchange: (e) => {
      const next = e.target.checked ? [...list, name] : list.filter((n) => n !== name);
      onChange(kind === "metric" ? { metrics: next } : { params: next });
    } }), " ", name);
  replace(panel,
    h("fieldset", { id: "metric-columns" }, h("legend", {}, `metrics (at most ${MAX_METRICS})`),
      allMetrics.length ? allMetrics.map((n) => box("metric", n, metrics.includes(n), metrics)) : h("span", { class: "muted small" }, "no metrics yet")),
    h("fieldset", { id: "param-columns" }, h("legend", {}, "params"),
      allParams.length ? allParams.map((n) => box("param", n, shownParams.includes(n), shownParams)) : h("span", { class: "muted small" }, "no params")));
}

// The metric filter bar: the active filters as chips (× removes one), and a form adding one
// on a shown metric column. `onChange(filters)` with the new list.
export function filterBar(bar, { cols, onChange }) {
  const metrics = metricColumns(cols);
  const name = h("select", { id: "filter-metric", "aria-label": "metric" }, metrics.map((n) => h("option", { value: n }, n)));
  const op = h("select", { id: "filter-op", "aria-label": "comparison" }, Object.entries(OPS).map(([k, t]) => h("option", { value: k }, t)));
  const value = h("input", { id: "filter-value", type: "number", step: "any", size: 6, placeholder: "0.9", "aria-label": "value" });
  const add = (e) => {
    e.preventDefault();
    const f = parseFilter(`metric:${name.value}:${op.value}:${value.value.trim()}`);
    if (f && cols.filters.length < MAX_FILTERS) onChange([...cols.filters, f]);
  };
  replace(bar,
    cols.filters.map((f, i) => h("span", { class: "chip on metric-filter", dataset: { filter: filterText(f) } }, `${f.name} ${OPS[f.op]} ${f.value} `,
      h("button", { class: "link-button clear-filter", title: "remove this filter", onclick: () => onChange(cols.filters.filter((_, j) => j !== i)) }, "×"))),
    metrics.length && cols.filters.length < MAX_FILTERS
      ? h("form", { id: "filter-form", class: "inline-form", onsubmit: add }, name, op, value, h("button", { type: "submit", id: "add-filter" }, "filter"))
      : null);
}
