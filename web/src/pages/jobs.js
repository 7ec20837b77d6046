// The jobs table: a server-side page of at most PAGE rows (so 10,000 jobs cost what 100
// do), filtered by state, text and tag (a click on a job's tag), reloaded whenever the jobs
// stream says a job changed. The params of the jobs shown are columns (params.js); which
// metric and param columns show, the order (a click on a column's head) and metric filters
// are chosen (runcols.js) and kept in the URL.
import { api, query, serverNow, stream } from "../api.js";
import { fmtAge, fmtNum, h, jobStateBadge, link, progressCell, replace, throttle, workersCell } from "../dom.js";
import { chosenParamColumns, paramCell, paramColumns, paramNames } from "../params.js";
import { columnsPanel, columnsQuery, columnsUrl, filterBar, metricColumns, readColumns, sortHead } from "../runcols.js";
import { JOB_STATES as STATES } from "../states.gen.js";
import { tagChips } from "./job_organise.js";
import { projectSelect } from "./projects.js";

const PAGE = 100;

export function jobsPage(root, { search, session, navigate }) {
  const view = {
    states: (search.get("state") || "").split(",").filter((s) => STATES.includes(s)),
    q: search.get("q") || "",
    tag: search.get("tag") || "",
    project: search.get("project") || "",
    page: Math.max(0, parseInt(search.get("page") || "0", 10) || 0),
    selected: new Set(),
    rows: [],
    metricNames: [], // the metric names the page's jobs have (the chooser's)
  };
  const cols = readColumns(search); // metrics, params, sort, filters
  const admin = session.is_admin;
  const chips = h("div", { class: "chips" });
  const hint = "filter by name or id" + (admin ? " or owner" : "");
  const searchBox = h("input", { type: "search", id: "job-filter", placeholder: hint, size: hint.length + 2, value: view.q }); // wide enough for its hint
  const compareBtn = h("button", { id: "compare", disabled: true, onclick: () => navigate("/compare" + query({ jobs: [...view.selected].join(","), metrics: cols.metrics && cols.metrics.join(",") })) }, "Compare");
  const colsPanel = h("div", { id: "columns-panel", class: "columns-panel", hidden: true });
  const colsBtn = h("button", { id: "columns", "aria-expanded": "false", onclick: () => {
    colsPanel.hidden = !colsPanel.hidden;
    colsBtn.setAttribute("aria-expanded", String(!colsPanel.hidden));
  } }, "Columns");
  const filters = h("span", { id: "metric-filters", class: "chips" });
  const pager = h("span", { class: "pager" });
  const tagFilter = h("span", { id: "tag-filter" });
  const projectFilter = projectSelect(view.project, (name) => { view.project = name; view.page = 0; keepUrl(); load(); });
  const tbody = h("tbody", {});
  const status = h("span", { class: "muted small", id: "live" }, "");
  const before = ["", "name", admin ? "owner" : null, "state", "progress"].filter((x) => x !== null);
  let params = []; // the param columns, after the metric columns
  const thead = h("thead", {});
  const table = h("table", { class: "jobs", id: "jobs-table" }, thead, tbody);
  replace(root,
    h("div", { class: "toolbar" }, chips, searchBox, projectFilter, tagFilter, compareBtn, colsBtn, status, pager),
    h("div", { class: "toolbar" }, filters),
    colsPanel,
    h("div", { class: "table-wrap" }, table));

  let loading = false, dirty = false;
  async function load() {
    if (loading) { dirty = true; return; }
    loading = true;
    try {
      const body = await api("/v1/ui/jobs" + query({ state: view.states.join(","), q: view.q, tag: view.tag, project: view.project, offset: view.page * PAGE, limit: PAGE, ...columnsQuery(cols) }));
      view.rows = body.items;
      view.metricNames = body.metric_names || [];
      renderChips(body.counts);
      renderTagFilter();
      renderRows();
      renderColumns();
      renderPager(body.total);
      root.dataset.loaded = String((parseInt(root.dataset.loaded || "0", 10) || 0) + 1);
    } catch (e) {
      status.textContent = e.message;
    } finally {
      loading = false;
      if (dirty) { dirty = false; reload(); }
    }
  }
  const reload = throttle(load, 500);

  function keepUrl() {
    const q = query({ state: view.states.join(","), q: view.q, tag: view.tag, project: view.project, page: view.page || null, ...columnsUrl(cols) });
    history.replaceState(null, "", "/" + q);
  }

  function renderChips(counts) {
    const all = Object.values(counts).reduce((a, b) => a + b, 0);
    const chip = (label, n, on, click) => h("button", { class: on ? "chip on" : "chip", onclick: click, dataset: { state: label } }, `${label} ${n}`);
    replace(chips,
      chip("all", all, !view.states.length, () => { view.states = []; view.page = 0; keepUrl(); load(); }),
      STATES.filter((s) => counts[s]).map((s) => chip(s, counts[s], view.states.includes(s), () => {
        view.states = view.states.includes(s) ? view.states.filter((x) => x !== s) : [...view.states, s];
        view.page = 0; keepUrl(); load();
      })));
  }

  function renderHeads() {
    params = cols.params ? chosenParamColumns(view.rows, cols.params) : paramColumns(view.rows);
    const onSort = (sort) => { cols.sort = sort; view.page = 0; keepUrl(); load(); };
    replace(thead, h("tr", {}, before.map((t) => h("th", {}, t)),
      metricColumns(cols).map((m) => sortHead(m, `metric:${m}`, cols, onSort, { class: "metric num", dataset: { metric: m } })),
      params.map((c) => sortHead(c.name, `param:${c.name}`, cols, onSort, { class: c.numeric ? "param num" : "param", title: `params.${c.name}`, dataset: { param: c.name } })),
      h("th", {}, "workers"),
      sortHead("age", "created_at", cols, onSort)));
  }

  // A change of columns or filters: kept in the URL, the page read again.
  function setColumns(change) {
    Object.assign(cols, change);
    view.page = 0; keepUrl(); load();
  }

  function renderColumns() {
    columnsPanel(colsPanel, { cols, metricNames: view.metricNames, paramNames: paramNames(view.rows), shownParams: params.map((c) => c.name), onChange: setColumns });
    filterBar(filters, { cols, onChange: (f) => setColumns({ filters: f }) });
  }

  function renderRows() {
    renderHeads();
    if (!view.rows.length) {
      const filtered = view.states.length || view.q || view.tag || cols.filters.length || view.project;
      return replace(tbody, h("tr", { class: "empty" }, h("td", { colspan: before.length + metricColumns(cols).length + 2, class: "muted", id: "no-jobs" },
        filtered ? "No jobs match these filters." : view.page ? "No jobs on this page." : "No jobs yet.")));
    }
    replace(tbody, view.rows.map((j) => {
      const box = h("input", { type: "checkbox", checked: view.selected.has(j.id), onchange: () => {
        if (box.checked) view.selected.add(j.id); else view.selected.delete(j.id);
        compareBtn.disabled = view.selected.size < 2;
        compareBtn.textContent = view.selected.size ? `Compare (${view.selected.size})` : "Compare";
      } });
      return h("tr", { dataset: { id: j.id, state: j.state } },
        h("td", {}, box),
        h("td", { class: "name" }, link(`/jobs/${j.id}`, j.name), h("div", { class: "muted small mono" }, j.id.slice(0, 12)),
          j.project && !j.project.startsWith("~") ? h("div", { class: "muted small jproject" }, `project ${j.project}`) : null,
          j.tags && j.tags.length ? h("div", { class: "jtags" }, tagChips(j.tags, { onClick: filterTag })) : null),
        admin ? h("td", {}, j.owner) : null,
        h("td", {}, jobStateBadge(j), j.attempt > 1 ? h("span", { class: "muted small" }, ` #${j.attempt}`) : null),
        h("td", {}, progressCell(j.progress, j.state, j.pending_reason)),
        metricColumns(cols).map((m) => h("td", { class: "metric num", dataset: { metric: m } }, fmtNum(j.latest[m]))),
        params.map((col) => paramCell(j.params, col)),
        h("td", { class: "small" }, workersCell(j.world_size, j.workers)),
        h("td", { class: "age", dataset: { t: j.created_at } }, fmtAge((serverNow() - Date.parse(j.created_at)) / 1000)));
    }));
  }

  function filterTag(tag) {
    view.tag = tag; view.page = 0; keepUrl(); load();
  }

  function renderTagFilter() {
    replace(tagFilter, view.tag
      ? h("span", { class: "chip on" }, `tag: ${view.tag} `, h("button", { class: "link-button", id: "clear-tag", title: "every tag", onclick: () => filterTag("") }, "×"))
      : null);
  }

  function renderAges() {
    for (const td of tbody.querySelectorAll("td.age")) td.textContent = fmtAge((serverNow() - Date.parse(td.dataset.t)) / 1000);
  }

  function renderPager(total) {
    const first = total ? view.page * PAGE + 1 : 0;
    const last = Math.min(total, (view.page + 1) * PAGE);
    const go = (p) => () => { view.page = p; keepUrl(); load(); };
    replace(pager,
      h("button", { disabled: view.page === 0, onclick: go(view.page - 1), id: "prev" }, "‹ Prev"),
      h("span", { class: "small", id: "range" }, `${first}–${last} of ${total}`),
      h("button", { disabled: last >= total, onclick: go(view.page + 1), id: "next" }, "Next ›"));
  }

  let typing = null;
  searchBox.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => { view.q = searchBox.value.trim(); view.page = 0; keepUrl(); load(); }, 250);
  });

  // Live: the stream names changed jobs; the page reloads the rows it shows.
  const es = stream("/v1/ui/jobs/changes", { changes: reload }, {
    onOpen: () => { status.textContent = "live"; reload(); },
  });
  es.addEventListener("error", () => { status.textContent = "reconnecting…"; });
  const ages = setInterval(renderAges, 10_000);
  load();
  return () => { es.close(); clearInterval(ages); clearTimeout(typing); reload.cancel(); };
}
