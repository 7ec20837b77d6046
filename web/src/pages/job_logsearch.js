// The job page's log search: a box (#log-search) that searches the WHOLE log on the server
// (GET /v1/jobs/{id}/logs?grep=, a fixed string, not only the lines the page loaded) and
// lists each match with its context (#log-matches), "more" while the search has not reached
// the end. Each request scans a bounded part of the log; a click goes on through requests
// that find nothing until one finds some (at most MAX_ROUNDS per click).
import { api, jobPath, query } from "../api.js";
import { h, replace } from "../dom.js";

const PAGE_MATCHES = 100;
const CONTEXT = 2;
const MAX_ROUNDS = 16;

function lineEl(line, hit) {
  return h("div", { class: hit ? "log-line hit" : "log-line", dataset: { offset: line.offset } },
    h("span", { class: "log-offset" }, String(line.offset)), " ", line.text);
}

export function logSearch(id) {
  const input = h("input", { type: "search", id: "log-search", placeholder: "search the whole log ⏎", maxlength: "1000", size: "32" });
  const ignoreCase = h("input", { type: "checkbox", id: "log-search-ignore-case" });
  const status = h("span", { class: "small muted", id: "log-search-status" });
  const matches = h("div", { id: "log-matches", class: "log-matches" });
  const more = h("button", { id: "log-more", hidden: true }, "more");
  const el = h("div", { class: "log-search" },
    h("div", { class: "log-search-row" }, input, " ", h("label", { class: "small" }, ignoreCase, " ignore case"), " ", status),
    matches, more);
  let pattern = "", next = 0, found = 0, run = 0;

  async function search(fresh) {
    const mine = fresh ? ++run : run; // a new search makes an older one's answers stale
    if (fresh) {
      pattern = input.value;
      next = 0; found = 0;
      replace(matches);
      if (!pattern) { more.hidden = true; status.textContent = ""; return; }
    }
    more.disabled = true;
    status.className = "small muted";
    status.textContent = "searching…";
    try {
      for (let round = 0; round < MAX_ROUNDS; round++) {
        const answer = await api(jobPath(id) + "/logs" + query({
          grep: pattern, ignore_case: ignoreCase.checked, context: CONTEXT, offset: next, limit_matches: PAGE_MATCHES,
        }));
        if (mine !== run) return;
        for (const m of answer.matches) {
          matches.append(h("div", { class: "log-match" },
            m.before.map((c) => lineEl(c, false)), lineEl(m, true), m.after.map((c) => lineEl(c, false))));
        }
        found += answer.matches.length;
        next = answer.next_offset;
        more.hidden = answer.complete;
        status.textContent = `${found} match${found === 1 ? "" : "es"}` + (answer.complete ? "" : ` in the first ${next} bytes`);
        if (answer.complete || answer.matches.length) break;
      }
    } catch (e) {
      if (mine !== run) return;
      status.className = "small error-text";
      status.textContent = e.message;
    } finally {
      more.disabled = false;
    }
  }

  input.addEventListener("keydown", (e) => { if (e.key === "Enter") search(true); });
  input.addEventListener("search", () => { if (!input.value) search(true); }); // the clear button
  ignoreCase.addEventListener("change", () => { if (pattern) search(true); });
  more.addEventListener("click", () => search(false));
  return { el };
}
