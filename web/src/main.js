// The dashboard: logs in (a one-time secret from the URL's fragment, or a typed token),
// then routes the page's own paths to their views. Every view reads the API with the
// session cookie; nothing about the login is kept in the URL or in storage.
import "./style.css";
import { api, setCsrf, whenUnauthorized } from "./api.js";
import { h, link, replace } from "./dom.js";
import { jobsPage } from "./pages/jobs.js";
import { jobPage } from "./pages/job.js";
import { comparePage } from "./pages/compare.js";
import { workersPage } from "./pages/workers.js";
import { sweepsPage } from "./pages/sweeps.js";
import { projectPage, projectsPage } from "./pages/projects.js";
import { loginPage } from "./pages/login.js";

const ROUTES = [
  [/^\/$/, jobsPage],
  [/^\/jobs\/([0-9a-f]{1,64})$/, jobPage],
  [/^\/compare$/, comparePage],
  [/^\/sweeps$/, sweepsPage],
  // The sweep page (parallel coordinates and all) loads only when first opened.
  [/^\/sweeps\/([0-9a-f]{1,64})$/, async (root, ctx) => (await import("./pages/sweep.js")).sweepPage(root, ctx)],
  [/^\/workers$/, workersPage],
  [/^\/projects$/, projectsPage],
  [/^\/projects\/([^/]{1,400})$/, projectPage],
  [/^\/submit$/, async (root, ctx) => (await import("./pages/submit.js")).submitPage(root, ctx)],
];

const app = { session: null, cleanup: null, loginError: null, after: "/" };
const root = document.getElementById("app");

export function navigate(path, { replace: swap = false } = {}) {
  if (swap) history.replaceState(null, "", path);
  else history.pushState(null, "", path);
  render();
}

function header() {
  const nav = [["/", "Jobs"], ["/sweeps", "Sweeps"], ["/projects", "Projects"], ["/compare", "Compare"], ["/workers", "Workers"], ["/submit", "Submit"]];
  const here = location.pathname;
  return h("header", { class: "top" },
    h("a", { href: "/", "data-link": "", class: "brand" }, "torchyard"),
    h("nav", {}, nav.map(([path, label]) => {
      const a = link(path, label);
      if (path === here || (path === "/" && here.startsWith("/jobs/")) || (path === "/sweeps" && here.startsWith("/sweeps/")) || (path === "/projects" && here.startsWith("/projects/"))) a.className = "active";
      return a;
    })),
    h("span", { class: "who" },
      h("span", { id: "user" }, app.session.user), app.session.is_admin ? h("span", { class: "tag" }, "admin") : null,
      h("button", { class: "link-button", onclick: logOut }, "Log out")));
}

async function logOut() {
  try { await api("/v1/ui/session", { method: "DELETE", quiet: true }); } catch { /* ended already */ }
  app.session = null;
  setCsrf(null);
  navigate("/login");
}

async function render() {
  if (app.cleanup) { try { app.cleanup(); } catch { /* a view's own */ } app.cleanup = null; }
  const path = location.pathname;
  if (!app.session || path === "/login") {
    if (app.session && path === "/login") return navigate("/", { replace: true });
    if (path !== "/login") app.after = path + location.search;
    if (path !== "/login") history.replaceState(null, "", "/login");
    const main = h("main", { class: "login" });
    replace(root, main);
    app.cleanup = loginPage(main, { error: app.loginError, onLogin: loggedIn, after: app.after });
    return;
  }
  const main = h("main", {});
  replace(root, header(), main);
  const route = ROUTES.find(([re]) => re.test(path));
  if (!route) {
    replace(main, h("h2", {}, "Not found"), h("p", {}, "No such page. ", link("/", "All jobs")));
    return;
  }
  const params = path.match(route[0]).slice(1);
  const ctx = { params, search: new URLSearchParams(location.search), session: app.session, navigate };
  try {
    app.cleanup = (await route[1](main, ctx)) || null;
  } catch (e) {
    replace(main, h("div", { class: "error" }, e.message || String(e)));
  }
}

function loggedIn(session) {
  app.session = session;
  app.loginError = null;
  setCsrf(session.csrf);
  document.body.dataset.user = session.user;
  const to = app.after && app.after !== "/login" ? app.after : "/";
  app.after = "/";
  navigate(to, { replace: true });
}

async function boot() {
  // A one-time login secret arrives in the fragment, which no server ever sees; it is
  // taken out of the address bar (and so out of history) before anything else.
  const m = location.hash.match(/^#login=([A-Za-z0-9_-]{1,200})$/);
  if (location.hash) history.replaceState(null, "", location.pathname + location.search);
  if (m) {
    try {
      return loggedIn(await api("/v1/ui/sessions", { method: "POST", body: { login: m[1] }, quiet: true }));
    } catch (e) {
      app.loginError = e.status === 401
        ? "This login link has expired or was already used: run `torchyard ui` again, or paste a token."
        : e.message;
    }
  }
  try {
    const session = await api("/v1/ui/session", { quiet: true });
    app.session = session;
    setCsrf(session.csrf);
    document.body.dataset.user = session.user;
  } catch { app.session = null; }
  render();
}

whenUnauthorized(() => {
  if (!app.session) return;
  app.session = null;
  app.loginError = "Your session has ended: log in again.";
  app.after = location.pathname + location.search;
  render();
});

document.addEventListener("click", (e) => {
  const a = e.target.closest && e.target.closest("a[data-link]");
  if (!a || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
  e.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", render);
boot();
