// A job's params (its spec's `params`: name -> string, number or boolean) in the jobs table's
// columns and the job page's table. Values are text nodes (dom.js: never markup).
import { h } from "./dom.js";

export const MAX_PARAM_COLUMNS = 6;

// The params the table shows as columns, `{name, numeric}`: of the names the visible rows
// have, the most common first (a sweep's swept names are on every trial; ties in the order
// first seen), at most `max`; `numeric` when every value shown is a number (right-aligned).
export function paramColumns(rows, max = MAX_PARAM_COLUMNS) {
  const counts = new Map();
  for (const r of rows) for (const name of Object.keys(r.params || {})) counts.set(name, (counts.get(name) || 0) + 1);
  const names = [...counts.keys()].sort((a, b) => counts.get(b) - counts.get(a)).slice(0, max);
  return chosenParamColumns(rows, names);
}

// Columns for the params `names` (the jobs table's columns chooser), as `paramColumns`'.
export function chosenParamColumns(rows, names) {
  const isNumber = (r, n) => !r.params || r.params[n] == null || typeof r.params[n] === "number";
  return names.map((name) => ({ name, numeric: rows.every((r) => isNumber(r, name)) }));
}

// Every param name the rows have, the most common first.
export function paramNames(rows) {
  return paramColumns(rows, Infinity).map((c) => c.name);
}

export function paramHead(col) {
  return h("th", { class: col.numeric ? "param num" : "param", title: `params.${col.name}`, dataset: { param: col.name } }, col.name);
}

export function paramText(v) {
  if (v == null) return "–";
  return typeof v === "string" ? v : String(v);
}

// One cell of a param column (`paramColumns`'), the full value in its title.
export function paramCell(params, col) {
  const v = params ? params[col.name] : undefined;
  const text = paramText(v);
  return h("td", { class: col.numeric ? "param num" : "param", title: v == null ? null : text, dataset: { param: col.name } }, text);
}

// The job page's table of its params, or null when it has none.
export function paramsTable(params) {
  const names = Object.keys(params || {});
  if (!names.length) return null;
  return h("table", { id: "params", class: "params" },
    h("tbody", {}, names.map((n) => h("tr", { dataset: { param: n } },
      h("th", { class: "mono" }, n), h("td", {}, paramText(params[n]))))));
}
