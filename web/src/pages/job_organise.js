// What the job page lets one change about a job: its tags (add, remove) and notes (PATCH),
// Archive / Unarchive, Delete (an ended job, after asking) and "Re-run with changes" (the
// submit page with its spec filled in). Mutations go through api.js (the CSRF header); the
// server decides who may, and its refusal is shown where the button was.
import { api, jobPath } from "../api.js";
import { confirmCancel, h, replace } from "../dom.js";
import { JOB_TERMINAL as TERMINAL } from "../states.gen.js";

export const TAG_RE = /^[A-Za-z0-9_.:/=+-]{1,64}$/;

// A job's tags as small chips; `onRemove(tag)` adds a remove button to each.
export function tagChips(tags, { onRemove, onClick } = {}) {
  return (tags || []).map((t) => h("span", { class: "jtag", dataset: { tag: t } },
    onClick ? h("button", { class: "link-button", title: `only jobs tagged ${t}`, onclick: () => onClick(t) }, t) : t,
    onRemove ? h("button", { class: "link-button remove-tag", title: `remove ${t}`, onclick: () => onRemove(t) }, "×") : null));
}

// The tags and notes section. `changed(job)` is told the job each edit answers with.
export function organiser(id, changed) {
  let job = null, notesDirty = false;
  const tags = h("span", { class: "jtags", id: "job-tags" });
  // Both stay disabled until the job has been read: an edit is computed from its tags.
  const tagInput = h("input", { type: "text", id: "tag-input", placeholder: "add a tag ⏎", maxlength: "64", size: "16", disabled: true });
  const notes = h("textarea", { id: "job-notes", rows: "3", maxlength: "10000", placeholder: "notes about this run", disabled: true });
  const save = h("button", { id: "save-notes", disabled: true }, "Save notes");
  const message = h("span", { class: "small", id: "organise-message" });
  const el = h("section", { class: "organise" },
    h("div", { class: "tag-row" }, h("span", { class: "muted" }, "tags"), tags, tagInput),
    h("div", { class: "notes-row" }, notes, h("div", {}, save, " ", message)));

  function say(text, bad = false) {
    message.className = bad ? "small error-text" : "small muted";
    message.textContent = text;
  }
  async function patch(body, done) {
    try {
      const answer = await api(jobPath(id), { method: "PATCH", body });
      if (done) done();
      say(body.notes !== undefined ? "saved" : "");
      changed(answer);
    } catch (e) {
      say(e.message, true);
    }
  }
  function renderTags() {
    replace(tags, job.tags.length ? tagChips(job.tags, { onRemove: (t) => patch({ tags: job.tags.filter((x) => x !== t) }) })
      : h("span", { class: "muted small" }, "none"));
  }
  tagInput.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || !job) return;
    const t = tagInput.value.trim();
    if (!t) return;
    if (!TAG_RE.test(t)) return say(`a tag is 1 to 64 letters, digits or _ . : / = + -`, true);
    if (job.tags.includes(t)) { tagInput.value = ""; return; }
    patch({ tags: [...job.tags, t] }, () => { tagInput.value = ""; });
  });
  notes.addEventListener("input", () => { notesDirty = true; save.disabled = false; say(""); });
  save.addEventListener("click", () => patch({ notes: notes.value }, () => { notesDirty = false; save.disabled = true; }));

  return {
    el,
    // The job as last read: tags always, the notes unless they are being edited.
    update(j) {
      job = j;
      tagInput.disabled = notes.disabled = false;
      renderTags();
      if (!notesDirty) notes.value = j.notes || "";
    },
  };
}

// The head's buttons: Re-run with changes, Archive/Unarchive, Delete… (once it has ended).
export function headActions(job, { dialog, errorsIn, refresh, navigate }) {
  const fail = (e) => errorsIn.append(h("span", { class: "error-text" }, e.message));
  const archive = async () => {
    try { await api(`${jobPath(job.id)}/${job.archived ? "unarchive" : "archive"}`, { method: "POST" }); } catch (e) { fail(e); }
    refresh();
  };
  let deleted = false;
  const del = () => confirmCancel(dialog, {
    question: ["Delete ", h("strong", {}, job.name), " with its checkpoints, metrics and logs, for good?"],
    label: "Delete job", keep: "Keep it", path: jobPath(job.id), errorsIn,
    post: async (path) => { await api(path, { method: "DELETE" }); deleted = true; },
    after: () => (deleted ? navigate("/") : refresh()),
  });
  return [
    job.archived ? h("span", { class: "state", id: "archived-badge" }, "archived") : null,
    h("button", { id: "rerun", title: "open the submit page with this job's spec", onclick: () => navigate(`/submit?rerun=${job.id}`) }, "Re-run with changes"),
    h("button", { id: "archive", onclick: archive }, job.archived ? "Unarchive" : "Archive"),
    TERMINAL.has(job.state) ? h("button", { class: "danger", id: "delete", onclick: del }, "Delete…") : null,
  ];
}
