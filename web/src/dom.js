// DOM building without HTML strings: every value from the server becomes a text node or
// an attribute, never markup, so a job name like <img onerror=…> shows as text.
import { JOB } from "./states.gen.js";

export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value == null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "value") el.value = value;
    else if (key === "checked") el.checked = !!value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child == null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

// An internal link: the router handles the click (no page load).
export function link(path, ...children) {
  return h("a", { href: path, "data-link": "" }, ...children);
}

export function fmtNum(v) {
  if (v == null || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
  return String(Number(v.toPrecision(4)));
}

export function fmtDuration(s) {
  if (s == null || !Number.isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const hh = Math.floor(s / 3600), mm = Math.floor((s % 3600) / 60), ss = s % 60;
  const two = (n) => String(n).padStart(2, "0");
  return hh ? `${hh}:${two(mm)}:${two(ss)}` : `${mm}:${two(ss)}`;
}

export function fmtAge(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, seconds);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

export function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function fmtTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

export function stateBadge(state) {
  return h("span", { class: `state state-${String(state).replace(/[^a-z_]/g, "")}` }, state);
}

// A job's badge: a trial its sweep's pruner stopped reads `pruned` (its state stays
// cancelled, which the tooltip says), any other job its state.
export function jobStateBadge(job) {
  if (!job.pruned) return stateBadge(job.state);
  return h("span", { class: "state state-pruned", title: `its sweep's pruner stopped it (state: ${job.state})` }, "pruned");
}

// Why a queued job waits, as the scheduler last said (`reason`), or that it has not yet.
export function pendingText(reason) {
  return reason || "not looked at by the scheduler yet";
}

// A job's progress; a queued one's is why it waits (`pendingReason`).
export function progressCell(p, state, pendingReason) {
  if (!p || p.step == null) {
    if (state !== JOB.QUEUED) return h("span", { class: "muted" }, "–");
    const why = pendingText(pendingReason);
    return h("span", { class: "muted small pending-cell", title: `waiting: ${why}` }, `waiting: ${why}`);
  }
  const frac = p.total_steps ? Math.min(1, p.step / p.total_steps) : null;
  const bar = h("div", { class: "bar" }, h("div", { class: "fill" }));
  if (frac != null) bar.firstChild.style.width = `${(frac * 100).toFixed(1)}%`;
  const eta = p.eta_s != null && state === JOB.RUNNING ? ` · ETA ${fmtDuration(p.eta_s)}` : "";
  const text = p.total_steps ? `${p.step}/${p.total_steps}${eta}` : `step ${p.step}${eta}`;
  return h("div", { class: "progress" }, bar, h("span", { class: "small" }, text));
}

// A job's world size: how many workers it runs on, one rank (process) on each, and each
// worker one GPU or the CPU. `ids`: the workers running it now, by rank.
export function workersCell(n, ids = []) {
  const count = `${n} worker${n === 1 ? "" : "s"}`;
  const title = `world_size ${n}: the job runs on ${count}, one rank (process) on each, each worker one GPU or CPU`
    + (ids.length ? `; now ${ids.map((w, r) => `rank ${r} on ${w}`).join(", ")}` : "");
  return h("span", { class: "workers", title }, ids.length ? ids.join(", ") : count);
}

// Call fn at most once per `ms`, and once more after a burst (the latest state wins).
export function throttle(fn, ms) {
  let last = 0, timer = null;
  const run = () => { timer = null; last = Date.now(); fn(); };
  const wrapped = () => {
    if (timer) return;
    const wait = Math.max(0, last + ms - Date.now());
    timer = setTimeout(run, wait);
  };
  wrapped.cancel = () => { clearTimeout(timer); timer = null; };
  return wrapped;
}

// The cancel confirmation of the job and sweep pages: `question` (nodes) with "Keep running"
// (or `keep`) and `label`; on confirm `post(path)`, show an error in `errorsIn`, then
// `after()`. A job's delete asks the same way.
export function confirmCancel(dialog, { question, label, path, errorsIn, after, post, keep = "Keep running" }) {
  replace(dialog,
    h("form", { method: "dialog" },
      h("p", {}, ...question),
      h("div", { class: "buttons" },
        h("button", { value: "keep", id: "keep-running" }, keep),
        h("button", { value: "cancel", class: "danger", id: "confirm" }, label))));
  dialog.onclose = async () => {
    if (dialog.returnValue !== "cancel") return;
    try { await post(path); } catch (e) { errorsIn.append(h("span", { class: "error-text" }, e.message)); }
    after();
  };
  dialog.showModal();
}
