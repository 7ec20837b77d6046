// Submit a spec: paste or upload JSON or YAML. Each problem (the YAML's, else the server's
// 422 ones) is listed once, under the editor, with the line it is on, which the gutter
// marks (the spec is parsed here with positions, so a field's line is known in either
// format); the marked line's tooltip says what is wrong there. `?rerun=<job id>`: the page
// opens with that job's spec ("Re-run with changes"), and the new job records it.
import { parseDocument, isMap, isSeq, stringify } from "yaml";
import { ApiError, api, jobPath, query } from "../api.js";
import { h, link, replace } from "../dom.js";

const EXAMPLE = `# A built-in model on a built-in data set (JSON works too)
name: digits-mlp
model: {name: mlp, hidden: [128]}
data: {name: digits, val_fraction: 0.2}
optimizer: {name: adam, lr: 0.003}
batch_size: 64
epochs: 12
log_every_steps: 5
`;

function lineAt(text, offset) {
  let line = 1;
  for (let i = 0; i < offset && i < text.length; i++) if (text.charCodeAt(i) === 10) line++;
  return line;
}

// The line of a dotted field ("optimizer.lr", "model.hidden.0"): its key's line, or the
// nearest enclosing one that is there (a missing field is reported where it belongs).
export function fieldLine(doc, text, field) {
  const path = String(field).split(".").map((p) => (/^\d+$/.test(p) ? Number(p) : p));
  for (let n = path.length; n > 0; n--) {
    const parent = n === 1 ? doc.contents : doc.getIn(path.slice(0, n - 1), true);
    const key = path[n - 1];
    if (isMap(parent)) {
      const pair = parent.items.find((p) => (p.key && (p.key.value ?? p.key.source)) === key);
      if (pair && pair.key && pair.key.range) return lineAt(text, pair.key.range[0]);
    } else if (isSeq(parent) && typeof key === "number" && parent.items[key] && parent.items[key].range) {
      return lineAt(text, parent.items[key].range[0]);
    }
  }
  return 1;
}

// A YAML error's message without the position and the excerpt the yaml package appends
// ("… at line 3, column 1:\n\n<the lines>\n^"): the list says the line itself.
export function yamlMessage(e) {
  return String(e.message).split("\n")[0].replace(/\s*at line \d+, column \d+\s*:?\s*$/, "").replace(/:\s*$/, "");
}

// The spec a re-run of `job` starts from: its stored spec, its tags (kept beside the spec),
// and its project unless that is a personal one (a re-run lands in one's own).
export function rerunSpec(job) {
  const spec = structuredClone(job.spec || {});
  if (job.tags && job.tags.length && !("tags" in spec)) spec.tags = [...job.tags];
  if (job.project && !String(job.project).startsWith("~") && !("project" in spec)) spec.project = job.project;
  return spec;
}

export function submitPage(root, { navigate, search }) {
  const rerunOf = /^[0-9a-f]{32}$/.test((search && search.get("rerun")) || "") ? search.get("rerun") : null;
  const area = h("textarea", { id: "spec-text", spellcheck: "false", wrap: "off", placeholder: "paste a job spec (JSON or YAML)" });
  area.value = EXAMPLE;
  const gutter = h("div", { class: "gutter" });
  const problems = h("ul", { class: "problems", id: "problems" });
  const result = h("div", { id: "submit-result" });
  const file = h("input", { type: "file", accept: ".json,.yaml,.yml,application/json,text/yaml", id: "spec-file" });
  const button = h("button", { class: "primary", id: "submit" }, "Submit");
  const banner = h("div", { id: "rerun-banner" });
  replace(root,
    h("div", { class: "toolbar" }, h("h2", {}, rerunOf ? "Re-run a job" : "Submit a job"), file, button),
    banner,
    h("div", { class: "editor" }, gutter, area),
    result, problems,
    h("p", { class: "muted small" }, "Jobs that run your own code need their bundle uploaded first: ", h("code", {}, "torchyard submit SPEC --code DIR"), "."));

  let marks = new Map(); // line -> [messages]
  function renderGutter() {
    const lines = area.value.split("\n").length;
    replace(gutter, Array.from({ length: lines }, (_, i) => {
      const bad = marks.get(i + 1);
      return h("div", { class: bad ? "ln bad" : "ln", title: bad ? bad.join("\n") : null }, i + 1);
    }));
    syncScroll();
  }
  function syncScroll() {
    gutter.scrollTop = area.scrollTop;
  }
  // [{field (none for the YAML's own), message, line}]: each shown once (the YAML parser
  // may report one mistake more than once).
  function show(list) {
    const seen = new Set();
    list = list.filter((p) => {
      const key = `${p.line}\0${p.field || ""}\0${p.message}`;
      return seen.has(key) ? false : seen.add(key);
    });
    marks = new Map();
    for (const p of list) marks.set(p.line, [...(marks.get(p.line) || []), p.field ? `${p.field}: ${p.message}` : p.message]);
    renderGutter();
    replace(problems, list.map((p) => h("li", { dataset: { field: p.field || "", line: p.line } },
      h("button", { class: "link-button", onclick: () => goTo(p.line) }, `line ${p.line}`), " ",
      p.field ? [h("code", { class: "field" }, p.field), " "] : null, h("span", { class: "message" }, p.message))));
  }
  function goTo(line) {
    const starts = [0];
    for (let i = 0; i < area.value.length; i++) if (area.value[i] === "\n") starts.push(i + 1);
    area.focus();
    area.setSelectionRange(starts[line - 1] || 0, (starts[line] || area.value.length + 1) - 1);
  }

  async function submit() {
    replace(result);
    const text = area.value;
    const doc = parseDocument(text, { prettyErrors: true, uniqueKeys: true });
    if (doc.errors.length) {
      show(doc.errors.map((e) => ({ field: null, message: yamlMessage(e), line: e.linePos ? e.linePos[0].line : 1 })));
      return;
    }
    const spec = doc.toJS();
    button.disabled = true;
    try {
      const job = await api("/v1/jobs" + query({ rerun_of: rerunOf }), { method: "POST", body: spec });
      show([]);
      replace(result, h("div", { class: "ok" }, "Submitted ", link(`/jobs/${job.id}`, job.name), " (", job.state, ")"),
        job.warnings.length ? h("ul", { class: "warnings" }, job.warnings.map((w) => h("li", {}, h("code", {}, w.field), " ", w.message))) : null);
      if (!job.warnings.length) navigate(`/jobs/${job.id}`);
    } catch (e) {
      if (!(e instanceof ApiError)) throw e;
      const details = Array.isArray(e.details) ? e.details.filter((d) => d && d.field) : [];
      if (details.length) show(details.map((d) => ({ field: d.field, message: d.message, line: fieldLine(doc, text, d.field) })));
      else { show([]); replace(result, h("div", { class: "error" }, `${e.status}: ${e.message}`)); }
    } finally {
      button.disabled = false;
    }
  }

  area.addEventListener("input", () => { if (marks.size) { marks = new Map(); replace(problems); } renderGutter(); });
  area.addEventListener("scroll", syncScroll);
  button.addEventListener("click", () => submit());
  file.addEventListener("change", async () => {
    const f = file.files && file.files[0];
    if (!f) return;
    area.value = await f.text();
    marks = new Map();
    replace(problems);
    renderGutter();
  });
  async function loadRerun() {
    button.disabled = true; // not the example, by a quick click
    try {
      const job = await api(jobPath(rerunOf));
      area.value = stringify(rerunSpec(job));
      replace(banner, h("p", { class: "muted" }, "Re-running ", link(`/jobs/${job.id}`, job.name),
        ": change what you like, then Submit. The new job records which job it came from."));
      renderGutter();
    } catch (e) {
      replace(banner, h("div", { class: "error" }, e.status === 404 ? `No job ${rerunOf} that you can see.` : e.message));
    } finally {
      button.disabled = false;
    }
  }
  renderGutter();
  if (rerunOf) loadRerun();
  return null;
}
