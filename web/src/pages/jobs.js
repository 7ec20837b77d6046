// The jobs table: a server-side page of at most PAGE rows (so 10,000 jobs cost what 100
// do), filtered by state, text and tag (a click on a job's tag), reloaded whenever the jobs
// stream says a job changed. The params of the jobs shown are columns (params.js).
import { api, query, serverNow, stream } from "../api.js";
import { fmtAge, fmtNum, h, jobStateBadge, link, progressCell, replace, throttle, workersCell } from "../dom.js";
import { paramCell, paramColumns, paramHead } from "../params.js";
import { JOB_STATES as STATES } from "../states.gen.js";
import { tagChips } from "./job_organise.js";

const PAGE = 100;

export function jobsPage(root, { search, session, navigate }) {
  const view = {
    states: (search.get("state") || "").split(",").filter((s) => STATES.includes(s)),
    q: search.get("q") || "",
    tag: search.get("tag") || "",
    page: Math.max(0, parseInt(search.get("page") || "0", 10) || 0),
    selected: new Set(),
    rows: [],
  };
  const admin = session.is_admin;
  const chips = h("div", { class: "chips" });
  const hint = "filter by name or id" + (admin ? " or owner" : "");
  const searchBox = h("input", { type: "search", id: "job-filter", placeholder: hint, size: hint.length + 2, value: view.q }); // wide enough for its hint
  const compareBtn = h("button", { id: "compare", disabled: true, onclick: () => navigate(`/compare?jobs=${[...view.selected].join(",")}`) }, "Compare");
  const pager = h("span", { class: "pager" });
  const tagFilter = h("span", { id: "tag-filter" });
  const tbody = h("tbody", {});
  const status = h("span", { class: "muted small", id: "live" }, "");
  const before = ["", "name", admin ? "owner" : null, "state", "progress", "train/loss", "val/accuracy"].filter((x) => x !== null);
  const after = ["workers", "age"];
  let params = []; // the param columns, between val/accuracy and workers
  const thead = h("thead", {});
  const table = h("table", { class: "jobs", id: "jobs-table" }, thead, tbody);
  replace(root,
    h("div", { class: "toolbar" }, chips, searchBox, tagFilter, compareBtn, status, pager),
    h("div", { class: "table-wrap" }, table));

  let loading = false, dirty = false;
  async function load() {
    if (loading) { dirty = true; return; }
    loading = true;
    try {
      const body = await api("/v1/ui/jobs" + query({ state: view.states.join(","), q: view.q, tag: view.tag, offset: view.page * PAGE, limit: PAGE }));
      view.rows = body.items;
      renderChips(body.counts);
      renderTagFilter();
      renderRows();
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
    const q = query({ state: view.states.join(","), q: view.q, tag: view.tag, page: view.page || null });
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
    params = paramColumns(view.rows);
    replace(thead, h("tr", {}, before.map((t) => h("th", {}, t)),
      params.map(paramHead),
      after.map((t) => h("th", {}, t))));
  }

  function renderRows() {
    renderHeads();
    if (!view.rows.length) {
      const filtered = view.states.length || view.q || view.tag;
      return replace(tbody, h("tr", { class: "empty" }, h("td", { colspan: before.length + after.length, class: "muted", id: "no-jobs" },
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
        h("td", { class: "num" }, fmtNum(j.latest["train/loss"])),
        h("td", { class: "num" }, fmtNum(j.latest["val/accuracy"])),
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
