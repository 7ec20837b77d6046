// One job: state and attempts (with their causes), pending reason, progress, one chart per
// metric group (live while it runs), the log (followed while it runs), checkpoints with
// their download links, Cancel, and the spec, its params as a table (params.js). Live
// through the job's own event stream.
// Its tags, notes, archive, delete and re-run: job_organise.js. Its System panel (the
// workers' samples, by time): job_system.js. The log's search box:
// job_logsearch.js. Its artifacts (a table and the images): job_artifacts.js.
import { api, jobPath, query, stream } from "../api.js";
import { MetricChart, color, dash, metricGroups } from "../chart.js";
import { confirmCancel as confirmCancelDialog, fmtBytes, fmtDuration, fmtTime, h, link, pendingText, jobStateBadge, progressCell, replace, stateBadge, throttle, workersCell } from "../dom.js";
import { ATTEMPT, ATTEMPT_COUNTED, JOB, JOB_TERMINAL as TERMINAL } from "../states.gen.js";
import { paramsTable } from "../params.js";
import { headActions, organiser } from "./job_organise.js";
import { isSystem, systemPanel } from "./job_system.js";
import { logSearch } from "./job_logsearch.js";
import { artifactsPanel } from "./job_artifacts.js";

const LOG_TAIL = 256 * 1024;
const LOG_END = "4611686018427387904"; // 2**62, the largest offset: the answer is the size
const LOG_KEEP = 1024 * 1024; // characters kept on screen

function cause(a) {
  if (a.state === ATTEMPT.LOST) return "lost worker" + (a.reason ? `: ${a.reason}` : "");
  if (a.state === ATTEMPT.HANDED_BACK) return /preempt/i.test(a.reason || "") ? `preempted: ${a.reason}` : `handed back${a.reason ? `: ${a.reason}` : ""}`;
  return a.reason || "";
}

// The attempt line: hand-backs (a stopping or preempted worker) do not count against
// max_restarts, failed and lost attempts do (store/lifecycle.py: counted_failures), so
// "2 (1 hand-back, not counted; restarts used 0 of 2)", not "2 (max restarts 2)".
function attemptText(job) {
  const handed = job.attempts.filter((a) => a.state === ATTEMPT.HANDED_BACK).length;
  const used = job.attempts.filter((a) => ATTEMPT_COUNTED.has(a.state)).length;
  const hb = handed ? `${handed} hand-back${handed === 1 ? "" : "s"}, not counted; ` : "";
  return `${job.attempt} (${hb}restarts used ${used} of ${job.max_restarts})`;
}

// Whether the caller may change the job (cancel, edit, archive, re-run): admins, and the
// members and owners of its project. A viewer's page is read-only; the server decides
// either way (403), this only spares them buttons that cannot work.
async function mayChange(job, session) {
  if (session && session.is_admin) return true;
  try {
    const project = await api(`/v1/projects/${encodeURIComponent(job.project)}`);
    return project.role === "member" || project.role === "owner";
  } catch { return true; } // unknown: show the buttons, the server answers
}

export async function jobPage(root, { params, navigate, session }) {
  const id = params[0];
  let start;
  try {
    start = (await api(`/v1/ui/jobs/${id}/stream-start`)).last_event_id;
  } catch (e) {
    replace(root, h("h2", {}, "Job not found"), h("p", { class: "muted" }, e.status === 404 ? `No job ${id} that you can see.` : e.message), link("/", "All jobs"));
    return null;
  }
  const parts = {
    head: h("section", { class: "job-head" }), info: h("section", { class: "info" }), params: h("section", { id: "params-section" }),
    attempts: h("section", {}), charts: h("section", { class: "charts", id: "charts" }),
    checkpoints: h("section", {}), logs: h("pre", { class: "log", id: "log" }), spec: h("pre", { class: "spec", id: "spec" }),
  };
  const dialog = h("dialog", { id: "confirm-cancel" });
  const org = organiser(id, () => refreshJob());
  const system = systemPanel(id); // the workers' sys/ series, on a time axis
  replace(root, parts.head, parts.info, parts.params, org.el, parts.charts, system.el, parts.attempts, parts.checkpoints,
    h("section", {}, h("h2", {}, "Log"), logSearch(id).el, parts.logs), h("section", {}, h("h2", {}, "Spec"), parts.spec), dialog);

  const artifacts = artifactsPanel(id);
  parts.checkpoints.after(artifacts.el); // the job's files, below its checkpoints
  const charts = new Map(); // group title -> MetricChart
  let job = null, es = null, logOffset = null, closed = false, canChange = null;

  async function refreshJob() {
    job = await api(jobPath(id));
    if (canChange === null) {
      canChange = await mayChange(job, session);
      if (!canChange) org.el.style.display = "none"; // CSS display beats `hidden`
      root.dataset.readonly = canChange ? "" : "true";
    }
    renderHead(); renderInfo(); renderParams(); renderAttempts(); org.update(job);
    parts.spec.textContent = JSON.stringify(job.spec, null, 2);
    ensureCharts(Object.keys(job.latest_metrics));
    root.dataset.state = job.state;
  }

  function renderHead() {
    const live = !TERMINAL.has(job.state);
    const cancel = canChange && live && job.state !== JOB.CANCELLING
      ? h("button", { class: "danger", id: "cancel", onclick: confirmCancel }, "Cancel…") : null;
    const actions = canChange
      ? headActions(job, { dialog, errorsIn: parts.head, refresh: () => refreshJob().catch(() => {}), navigate })
      : h("span", { class: "muted small", id: "read-only" }, `view only: you are a viewer of ${job.project}`);
    replace(parts.head,
      h("div", {}, h("h1", { id: "job-name" }, job.name), h("div", { class: "muted mono small" }, job.id),
        job.sweep_id ? h("div", { class: "small", id: "job-sweep" }, "a trial of ", link(`/sweeps/${job.sweep_id}`, `sweep ${job.sweep_id.slice(0, 12)}`)) : null),
      h("div", { class: "head-right" }, h("span", { id: "job-state" }, jobStateBadge(job)), cancel, actions));
  }

  function renderInfo() {
    const p = job.progress;
    const queued = job.state === JOB.QUEUED;
    // A queued job's progress is why it waits (once: not "waiting" and the reason again).
    const waiting = job.pending_reason
      ? h("span", { id: "pending" }, job.pending_reason)
      : queued ? h("span", { class: "muted", id: "pending-none" }, pendingText(null)) : null;
    const rows = [
      ["owner", job.owner], ["project", job.project], ["attempt", h("span", { id: "attempt-line" }, attemptText(job))],
      job.rerun_of ? ["re-run of", link(`/jobs/${job.rerun_of}`, h("span", { class: "mono", id: "rerun-of" }, job.rerun_of.slice(0, 12)))] : null,
      !queued || (p && p.step != null) ? ["progress", progressCell(p, job.state)] : null,
      p && p.samples_per_s ? ["speed", `${Math.round(p.samples_per_s).toLocaleString()} samples/s`] : null,
      waiting ? ["waiting because", waiting] : null,
      job.error ? ["error", h("span", { class: "error-text", id: "job-error" }, job.error)] : null,
      ["submitted", fmtTime(job.created_at)], ["started", fmtTime(job.started_at)], ["finished", fmtTime(job.finished_at)],
      ["workers", workersCell(job.world_size)],
    ].filter(Boolean);
    replace(parts.info, h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])));
  }

  function renderParams() {
    const table = paramsTable(job.spec.params);
    replace(parts.params, table ? [h("h2", {}, "Params"), table] : null);
  }

  function renderAttempts() {
    const duration = (a) => a.started_at ? fmtDuration(((a.ended_at ? Date.parse(a.ended_at) : Date.now()) - Date.parse(a.started_at)) / 1000) : "–";
    replace(parts.attempts, h("h2", {}, "Attempts"), job.attempts.length
      ? h("table", { id: "attempts" },
        h("thead", {}, h("tr", {}, ["#", "state", "cause", "exit", "workers", "started", "ran"].map((t) => h("th", {}, t)))),
        h("tbody", {}, job.attempts.map((a) => h("tr", {},
          h("td", {}, a.number), h("td", {}, stateBadge(a.state)), h("td", { class: "cause" }, cause(a)),
          h("td", {}, a.exit_code ?? "–"), h("td", { class: "small" }, a.workers.map((w) => w.worker_id).join(", ")),
          h("td", { class: "small" }, fmtTime(a.started_at)), h("td", {}, duration(a))))))
      : h("p", { class: "muted" }, "No attempt yet."));
  }

  function ensureCharts(names) {
    system.update(names);
    for (const group of metricGroups(names.filter((n) => !isSystem(n)))) {
      const chart = charts.get(group.title);
      if (chart && group.names.every((n) => chart.sources.some((s) => s.name === n))) continue;
      const el = h("div", { class: "chart", dataset: { group: group.title } });
      const sources = group.names.map((name, i) => ({ job: id, name, label: name, color: color(i), dash: dash(i) }));
      if (chart) { chart.destroy(); chart.el.replaceWith(el); } else parts.charts.append(el);
      const c = new MetricChart(el, { title: group.title, sources });
      charts.set(group.title, c);
      c.load().catch((e) => { el.dataset.error = e.message; });
    }
    if (!charts.size) replace(parts.charts, h("p", { class: "muted", id: "no-metrics" }, "No metrics yet."));
    else parts.charts.querySelector("#no-metrics")?.remove();
  }

  async function refreshCheckpoints() {
    const items = (await api(jobPath(id) + "/checkpoints")).items;
    replace(parts.checkpoints, h("h2", {}, "Checkpoints"), items.length
      ? h("table", { id: "checkpoints" },
        h("thead", {}, h("tr", {}, ["step", "id", "kind", "size", "sha256", "attempt", "saved", ""].map((t) =>
          h("th", t === "id" ? { title: "torchyard download JOB --checkpoint id:N (or the step: --checkpoint STEP)" } : {}, t)))),
        h("tbody", {}, items.map((c) => h("tr", {},
          h("td", {}, c.step), h("td", { class: "mono small ckpt-id" }, c.id), h("td", {}, c.kind), h("td", {}, fmtBytes(c.bytes)),
          h("td", { class: "mono small sha" }, c.sha256), h("td", {}, c.attempt), h("td", { class: "small" }, fmtTime(c.created_at)),
          h("td", {}, c.available
            ? h("a", { href: `${jobPath(id)}/checkpoints/${c.id}/download${c.kind === "weights" ? "?kind=weights" : ""}`, download: "", class: "download" }, "Download")
            : h("span", { class: "muted small" }, "pruned"))))))
      : h("p", { class: "muted" }, "No checkpoint yet."));
  }

  // One read of the log at a time (two would append the same bytes twice); a call that
  // comes meanwhile reads again after it.
  let logBusy = false, logAgain = false;
  async function refreshLog() {
    if (logBusy) { logAgain = true; return; }
    logBusy = true;
    try { await readLog(); } finally {
      logBusy = false;
      if (logAgain && !closed) { logAgain = false; logSoon(); }
    }
  }

  async function readLog() {
    if (logOffset == null) { // start at the tail of a long log
      const end = await api(jobPath(id) + "/logs" + query({ offset: LOG_END, limit: 1 }));
      logOffset = Math.max(0, end.size - LOG_TAIL);
      if (logOffset > 0) parts.logs.append(`… (${fmtBytes(logOffset)} earlier)\n`);
    }
    for (let i = 0; i < 16; i++) {
      const chunk = await api(jobPath(id) + "/logs" + query({ offset: logOffset, limit: LOG_TAIL }));
      const atEnd = parts.logs.scrollTop + parts.logs.clientHeight >= parts.logs.scrollHeight - 4;
      if (chunk.data) parts.logs.append(chunk.data);
      if (parts.logs.textContent.length > LOG_KEEP) parts.logs.textContent = parts.logs.textContent.slice(-LOG_KEEP);
      if (atEnd) parts.logs.scrollTop = parts.logs.scrollHeight; // following
      logOffset = chunk.next_offset;
      if (!chunk.data || chunk.next_offset >= chunk.size) break;
    }
  }

  function confirmCancel() {
    confirmCancelDialog(dialog, {
      question: ["Cancel ", h("strong", {}, job.name), "? A running trainer checkpoints and stops."],
      label: "Cancel job", path: jobPath(id) + "/cancel", errorsIn: parts.head, after: refreshJob,
      post: (path) => api(path, { method: "POST" }),
    });
  }

  const quietly = (fn) => () => fn().catch(() => {});
  const jobSoon = throttle(quietly(refreshJob), 500);
  const logSoon = throttle(quietly(refreshLog), 1000);
  const ckptSoon = throttle(quietly(refreshCheckpoints), 1000);
  const artifactsSoon = throttle(quietly(artifacts.refresh), 5000); // no event of their own
  const progressSoon = throttle(quietly(refreshJob), 2000);

  function follow() {
    es = stream(`${jobPath(id)}/events${query({ last_event_id: start })}`, {
      metric: (m) => {
        if (isSystem(m.name)) { if (!system.append(m)) system.update([...system.names(), m.name]); return; }
        const chart = charts.get(metricGroups([m.name])[0].title);
        if (!chart || !chart.append(id, m.name, m.step, m.value)) ensureCharts([...allNames(), m.name]);
        progressSoon(); // progress moves with the curves; the stream does not carry it
        artifactsSoon();
      },
      state: () => { jobSoon(); artifactsSoon(); },
      checkpoint: () => { ckptSoon(); artifactsSoon(); },
      // What has no event of its own: the log grew, or the scheduler's reason changed.
      status: (s) => {
        if (logOffset != null && s.log_size > logOffset) logSoon();
        if (job && (s.pending_reason || null) !== (job.pending_reason || null)) jobSoon();
      },
      end: () => { stop(); refreshJob(); refreshCheckpoints(); refreshLog(); quietly(artifacts.refresh)(); for (const c of charts.values()) c.load(); system.load(); },
    });
  }
  const allNames = () => [...charts.values()].flatMap((c) => c.sources.map((s) => s.name));

  function stop() {
    if (es) es.close();
    es = null;
  }

  await refreshJob();
  await Promise.all([refreshCheckpoints(), refreshLog(), artifacts.refresh()].map((p) => p.catch(() => {})));
  if (!TERMINAL.has(job.state) && !closed) follow();
  return () => {
    closed = true;
    stop();
    jobSoon.cancel(); logSoon.cancel(); ckptSoon.cancel(); progressSoon.cancel(); artifactsSoon.cancel();
    for (const c of charts.values()) c.destroy();
    system.destroy();
  };
}
