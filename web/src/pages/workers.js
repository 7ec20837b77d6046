// The workers: host, device, state, current job and heartbeat age. Reloaded when the
// stream reports that workers changed (one registered, was lost or stopped, took or ended
// a job). Heartbeats are not events (a busy cluster beats many times a second), so the
// list is also re-read every 10 s for fresh ages; the ages tick in between, on the
// server's clock.
import { api, serverNow, stream } from "../api.js";
import { fmtAge, fmtBytes, h, link, replace, stateBadge, throttle } from "../dom.js";

export function workersPage(root) {
  const tbody = h("tbody", {});
  const summary = h("p", { class: "muted small" });
  replace(root, h("h2", {}, "Workers"), summary,
    h("table", { id: "workers" },
      h("thead", {}, h("tr", {}, ["worker", "host", "device", "state", "job", "heartbeat"].map((t) => h("th", {}, t)))), tbody));

  function device(w) {
    if (w.device === "cpu") return "CPU";
    const name = w.device_name || w.device;
    const mem = w.memory_bytes ? ` · ${fmtBytes(w.memory_bytes)}` : "";
    return `GPU ${w.gpu ?? "?"}: ${name}${mem}`;
  }

  async function load() {
    const items = (await api("/v1/workers")).items;
    const by = {};
    for (const w of items) by[w.state] = (by[w.state] || 0) + 1;
    summary.textContent = Object.entries(by).map(([s, n]) => `${n} ${s}`).join(" · ") || "No worker has registered.";
    replace(tbody, items.map((w) => h("tr", { dataset: { id: w.id } },
      h("td", { class: "mono small" }, w.id), h("td", {}, w.host), h("td", {}, device(w)), h("td", {}, stateBadge(w.state)),
      h("td", {}, w.current_job_id ? link(`/jobs/${w.current_job_id}`, w.current_job_id.slice(0, 12)) : "–"),
      h("td", { class: "age", dataset: { t: w.last_heartbeat } }, ""))));
    ages();
  }
  function ages() {
    for (const td of tbody.querySelectorAll("td.age")) td.textContent = fmtAge((serverNow() - Date.parse(td.dataset.t)) / 1000) + " ago";
  }
  const reload = throttle(() => load().catch(() => {}), 1000);
  const es = stream("/v1/ui/jobs/changes", { workers: reload });
  const timers = [setInterval(ages, 1000), setInterval(reload, 10_000)];
  load();
  return () => { es.close(); timers.forEach(clearInterval); reload.cancel(); };
}
