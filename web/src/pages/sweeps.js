// The sweeps table: name, state, objective, trials by status, the best value, created.
// Live while any sweep runs (followLive, shared with the sweep page).
import { api, query, stream } from "../api.js";
import { fmtNum, fmtTime, h, link, replace, stateBadge, throttle } from "../dom.js";
import { JOB } from "../states.gen.js";

const PAGE = 100;
const TICK_MS = 5000;
// A trial's statuses; a sweep's states and these share the job states' names (store/sweeps.py).
export const STATUSES = ["complete", "pruned", JOB.FAILED, JOB.CANCELLED, JOB.RUNNING, "paused"];

// Calls `refresh()` (at most every 2 s) while `live()` says so: when the jobs stream names a
// change (a trial's state or curve, a new trial's job), and every TICK_MS for what has no
// event of its own (the sweep controller's decisions: a trial's value, pruned, the end).
export function followLive(refresh, live) {
  if (!live()) return () => {};
  let es = null, timer = null;
  const stop = () => { if (es) es.close(); es = null; clearInterval(timer); soon.cancel(); };
  const soon = throttle(() => { refresh().then(() => { if (!live()) stop(); }).catch(() => {}); }, 2000);
  es = stream("/v1/ui/jobs/changes", { changes: () => soon() });
  timer = setInterval(soon, TICK_MS);
  return stop;
}

export function objectiveText(o) {
  return `${o.metric} (${o.mode === "max" ? "max ↑" : "min ↓"})`;
}

// "4/16" and the nonzero counts: "3 complete · 1 pruned".
export function countsCell(s) {
  const c = s.counts || {};
  const ended = STATUSES.filter((k) => k !== JOB.RUNNING && k !== "paused").reduce((n, k) => n + (c[k] || 0), 0);
  const parts = STATUSES.filter((k) => c[k]).map((k) => `${c[k]} ${k}`);
  return h("span", { class: "counts", title: `${ended} of ${s.max_trials} trials ended` },
    h("strong", {}, `${ended}/${s.max_trials}`), parts.length ? h("span", { class: "muted small" }, " · " + parts.join(" · ")) : null);
}

export function sweepsPage(root, { session }) {
  const admin = session.is_admin;
  const tbody = h("tbody", {});
  const more = h("button", { id: "more-sweeps", hidden: true, onclick: () => load(items.length + PAGE) }, "More");
  const heads = ["name", admin ? "owner" : null, "state", "objective", "trials", "best", "created"].filter(Boolean);
  replace(root,
    h("div", { class: "toolbar" }, h("h2", {}, "Sweeps")),
    h("div", { class: "table-wrap" }, h("table", { id: "sweeps-table" }, h("thead", {}, h("tr", {}, heads.map((t) => h("th", {}, t)))), tbody)),
    h("p", {}, more));
  let items = [];

  const row = (s) => h("tr", { dataset: { id: s.id } },
    h("td", { class: "name" }, link(`/sweeps/${s.id}`, s.name)),
    admin ? h("td", {}, s.owner) : null,
    h("td", {}, stateBadge(s.state)),
    h("td", { class: "small mono" }, objectiveText(s.objective)),
    h("td", {}, countsCell(s)),
    h("td", { class: "num best-value", title: s.best ? `trial #${s.best.number}` : null }, s.best ? fmtNum(s.best.value) : "–"),
    h("td", { class: "small" }, fmtTime(s.created_at)));

  async function load(limit = Math.max(PAGE, items.length)) {
    const body = await api("/v1/sweeps" + query({ limit: Math.min(500, limit) }));
    items = body.items;
    more.hidden = !body.next_cursor || items.length >= 500;
    replace(tbody, items.length ? items.map(row)
      : h("tr", {}, h("td", { colspan: heads.length, class: "muted" }, "No sweeps yet: start one with `torchyard sweep create FILE`.")));
    root.dataset.loaded = String((parseInt(root.dataset.loaded || "0", 10) || 0) + 1);
  }

  return load().then(() => followLive(load, () => items.some((s) => s.state === JOB.RUNNING || (s.counts && s.counts.running))));
}
