// A job's artifacts (job.save_artifact): a table with a download link each, and the images
// among them shown below it. An image is an <img> of the API's download URL, fetched by
// the browser with the session cookie like every other same-origin request of the page
// (api.js); the API serves it as an image only when its bytes are one (PNG, JPEG, GIF,
// WebP), never by its name, so an artifact called x.png holding HTML never renders here.
import { api, jobPath } from "../api.js";
import { fmtBytes, fmtTime, h, replace } from "../dom.js";

const IMAGE = /\.(png|jpe?g|gif|webp)$/i;

export function artifactsPanel(id) {
  const el = h("section", { id: "artifacts-panel" });
  let shown = ""; // the (name, sha256) list on screen: unchanged, nothing is redrawn

  async function refresh() {
    const items = (await api(jobPath(id) + "/artifacts")).items;
    const now = items.map((a) => `${a.name}:${a.sha256}`).join("/");
    if (now === shown && el.childElementCount) return;
    shown = now;
    const url = (a) => `${jobPath(id)}/artifacts/${encodeURIComponent(a.name)}/download`;
    const images = items.filter((a) => a.available && IMAGE.test(a.name));
    replace(el, h("h2", {}, "Artifacts"), items.length
      ? [h("table", { id: "artifacts" },
        h("thead", {}, h("tr", {}, ["name", "size", "sha256", "saved", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, items.map((a) => h("tr", { dataset: { name: a.name } },
          h("td", { class: "mono small artifact-name" }, a.name), h("td", {}, fmtBytes(a.bytes)),
          h("td", { class: "mono small sha" }, a.sha256), h("td", { class: "small" }, fmtTime(a.created_at)),
          h("td", {}, a.available
            ? h("a", { href: url(a), download: a.name, class: "download" }, "Download")
            : h("span", { class: "muted small" }, "gone")))))),
      images.length ? h("div", { class: "artifact-images", id: "artifact-images" }, images.map((a) =>
        h("figure", { dataset: { name: a.name } },
          // the sha256 in the URL: a name saved again is a new picture, not the cached one
          h("img", { src: `${url(a)}?v=${a.sha256.slice(0, 16)}`, alt: a.name, loading: "lazy",
            onerror: (e) => e.target.closest("figure").remove() }),
          h("figcaption", { class: "small mono" }, a.name)))) : null]
      : h("p", { class: "muted", id: "no-artifacts" }, "No artifacts (a script keeps files with job.save_artifact)."));
  }

  return { el, refresh };
}
