// Projects: the caller's projects (/projects: their role, members, running and queued jobs,
// usage against the quota) and one project's page (/projects/NAME: members and roles,
// quota and usage, its newest jobs, a link to the jobs table filtered to it). A project the
// caller has no role in is "not found", as the API says (whether it exists or not). Also
// the jobs table's project filter (projectSelect).
import { api, ApiError, query, serverNow, stream } from "../api.js";
import { fmtAge, fmtNum, h, jobStateBadge, link, progressCell, replace, throttle } from "../dom.js";
import { JOB } from "../states.gen.js";

const JOBS_SHOWN = 20;

export function projectPath(name) { return `/projects/${encodeURIComponent(name)}`; }

// "2 of 4" against a limit, or "2" with "no limit" when there is none.
function ofLimit(used, limit) {
  if (limit == null) return h("span", {}, String(used), h("span", { class: "muted small" }, " · no limit"));
  const over = used >= limit;
  return h("span", { class: over ? "at-limit" : null, title: over ? "at its quota's limit" : null }, `${used} of ${limit}`);
}

function personalTag(p) {
  return p.personal ? h("span", { class: "ptag", title: "a user's own project" }, "personal") : null;
}

// A select of the caller's projects (its value kept by the page that owns it); `current`
// stays an option even when it is not one of them (the API then says "not found").
export function projectSelect(current, onChange) {
  const select = h("select", { id: "project-filter", title: "only one project's jobs", onchange: () => onChange(select.value) },
    h("option", { value: "" }, "all projects"));
  const fill = (names) => {
    const all = current && !names.includes(current) ? [...names, current] : names;
    replace(select, h("option", { value: "" }, "all projects"), all.map((n) => h("option", { value: n }, n)));
    select.value = current;
    select.dataset.loaded = "1";
  };
  fill([]);
  select.dataset.loaded = "";
  api("/v1/projects").then((b) => fill(b.items.map((p) => p.name))).catch(() => fill([]));
  return select;
}

export function projectsPage(root) {
  const heads = ["project", "your role", "members", JOB.RUNNING, JOB.QUEUED, "workers", "worker-hours", "share"];
  const tbody = h("tbody", {});
  replace(root,
    h("div", { class: "toolbar" }, h("h2", {}, "Projects")),
    h("div", { class: "table-wrap" }, h("table", { id: "projects-table" }, h("thead", {}, h("tr", {}, heads.map((t) => h("th", {}, t)))), tbody)),
    h("p", { class: "muted small" }, "Workers and queued jobs against each project's quota; a project's limits hold on top of each user's own."));

  const row = (p) => h("tr", { dataset: { project: p.name } },
    h("td", { class: "name" }, link(projectPath(p.name), p.name), " ", personalTag(p)),
    h("td", { class: "role" }, p.role || h("span", { class: "muted" }, "admin")),
    h("td", { class: "num members" }, String(p.members)),
    h("td", { class: "num running" }, String(p.usage.running)),
    h("td", { class: JOB.QUEUED }, ofLimit(p.usage.queued, p.quota.max_queued)),
    h("td", { class: "workers-used" }, ofLimit(p.usage.workers, p.quota.max_workers)),
    h("td", { class: "num" }, fmtNum(p.usage.worker_hours)),
    h("td", { class: "num" }, fmtNum(p.quota.share)));

  async function load() {
    const body = await api("/v1/projects");
    replace(tbody, body.items.length ? body.items.map(row)
      : h("tr", {}, h("td", { colspan: heads.length, class: "muted" }, "No projects.")));
    root.dataset.loaded = String((parseInt(root.dataset.loaded || "0", 10) || 0) + 1);
  }
  return load().then(() => follow(load));
}

// Load again (at most every 2 s) whenever the jobs stream names a change: running and
// queued counts move with the jobs. Returns the page's cleanup.
function follow(load) {
  const soon = throttle(() => { load().catch(() => { /* the next change tries again */ }); }, 2000);
  const es = stream("/v1/ui/jobs/changes", { changes: () => soon() });
  return () => { es.close(); soon.cancel(); };
}

function notFound(root, name) {
  replace(root,
    h("h2", { id: "not-found" }, "Project not found"),
    h("p", {}, `No project ${name} that you have a role in. `, link("/projects", "Your projects")));
}

export async function projectPage(root, { params }) {
  let name;
  try { name = decodeURIComponent(params[0]); } catch { return notFound(root, params[0]); }
  const members = h("tbody", {});
  const usage = h("dl", { id: "project-usage" });
  const jobs = h("tbody", {});
  const title = h("h2", { id: "project-name" }, name);
  const role = h("p", { class: "muted", id: "project-role" });
  const allJobs = h("a", { href: "/" + query({ project: name }), "data-link": "", id: "project-all-jobs" }, "All its jobs in the jobs table →");

  function renderProject(p) {
    replace(title, p.name, " ", personalTag(p));
    role.textContent = p.role ? `Your role: ${p.role}` : "You are an admin (no role in it).";
    replace(members, p.members.map((m) => h("tr", { dataset: { user: m.user } }, h("td", {}, m.user), h("td", { class: "role" }, m.role))));
    const q = p.quota, u = p.usage;
    replace(usage,
      h("dt", {}, "Workers held"), h("dd", { id: "usage-workers" }, ofLimit(u.workers, q.max_workers), h("span", { class: "muted small" }, " (max_workers)")),
      h("dt", {}, "Queued jobs"), h("dd", { id: "usage-queued" }, ofLimit(u.queued, q.max_queued), h("span", { class: "muted small" }, " (max_queued)")),
      h("dt", {}, "Running jobs"), h("dd", { id: "usage-running" }, String(u.running)),
      h("dt", {}, "Recent usage"), h("dd", { id: "usage-hours" }, `${fmtNum(u.worker_hours)} worker-hours`, h("span", { class: "muted small" }, " (decayed, as fair share counts it)")),
      h("dt", {}, "Share"), h("dd", { id: "quota-share" }, fmtNum(q.share)));
  }

  function renderJobs(body) {
    if (!body.items.length) return replace(jobs, h("tr", {}, h("td", { colspan: 5, class: "muted", id: "no-project-jobs" }, "No jobs in this project yet.")));
    replace(jobs, body.items.map((j) => h("tr", { dataset: { id: j.id, state: j.state } },
      h("td", { class: "name" }, link(`/jobs/${j.id}`, j.name), h("div", { class: "muted small mono" }, j.id.slice(0, 12))),
      h("td", {}, j.owner),
      h("td", {}, jobStateBadge(j)),
      h("td", {}, progressCell(j.progress, j.state, j.pending_reason)),
      h("td", { class: "age" }, fmtAge((serverNow() - Date.parse(j.created_at)) / 1000)))));
    allJobs.textContent = body.total > body.items.length ? `All ${body.total} of its jobs in the jobs table →` : "Its jobs in the jobs table →";
  }

  async function load() {
    const [p, page] = await Promise.all([
      api(`/v1/projects/${encodeURIComponent(name)}`),
      api("/v1/ui/jobs" + query({ project: name, limit: JOBS_SHOWN })),
    ]);
    renderProject(p);
    renderJobs(page);
    root.dataset.loaded = String((parseInt(root.dataset.loaded || "0", 10) || 0) + 1);
  }

  try {
    await load();
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return notFound(root, name);
    throw e;
  }
  replace(root,
    h("div", { class: "toolbar" }, title), role,
    h("div", { class: "project-grid" },
      h("section", {}, h("h3", {}, "Members"),
        h("table", { id: "members-table" }, h("thead", {}, h("tr", {}, h("th", {}, "user"), h("th", {}, "role"))), members)),
      h("section", {}, h("h3", {}, "Quota and usage"), usage)),
    h("h3", {}, "Newest jobs"),
    h("div", { class: "table-wrap" }, h("table", { id: "project-jobs" },
      h("thead", {}, h("tr", {}, ["name", "owner", "state", "progress", "age"].map((t) => h("th", {}, t)))), jobs)),
    h("p", {}, allJobs));
  return follow(load);
}
