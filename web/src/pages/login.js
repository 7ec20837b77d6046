// The login page: sign in at the server's OpenID provider where it has one (a plain link:
// the server sends the browser there and back, and sets the session cookie itself), paste
// an API token (sent once, in a header, to open a session; never stored), or come back
// through `torchyard ui`'s one-time link.
import { api } from "../api.js";
import { h, replace } from "../dom.js";

// "Sign in with <provider>", shown once the server says it has single sign-on.
function ssoOffer(box, after) {
  api("/v1/ui/sso", { quiet: true }).then((info) => {
    if (!info || !info.enabled) return;
    const next = after && after !== "/" && after !== "/login" ? `?next=${encodeURIComponent(after)}` : "";
    replace(box,
      h("a", { class: "button primary", id: "sso", href: info.login_path + next }, `Sign in with ${info.name}`),
      h("p", { class: "muted small or" }, "or with an API token:"));
    box.hidden = false;
  }).catch(() => { /* no single sign-on offered: the token form stays */ });
}

export function loginPage(root, { error, onLogin, after }) {
  const input = h("input", { type: "password", id: "token", name: "token", autocomplete: "off", spellcheck: "false", placeholder: "ty_…", required: true });
  const message = h("p", { class: "error", id: "login-error" }, error || "");
  if (!error) message.hidden = true;
  const button = h("button", { type: "submit", class: "primary" }, "Log in");
  // method=post: should the script not run, a token is never put into a URL.
  const form = h("form", { method: "post", action: "/login", onsubmit: submit },
    h("label", { for: "token" }, "API token"), input, button);

  async function submit(e) {
    e.preventDefault();
    const token = input.value.trim();
    input.value = "";
    if (!token) return;
    button.disabled = true;
    try {
      onLogin(await api("/v1/ui/sessions", { method: "POST", body: {}, headers: { Authorization: `Bearer ${token}` }, quiet: true }));
    } catch (err) {
      message.hidden = false;
      message.textContent = err.status === 401 ? "That token is unknown or revoked." : err.message;
      button.disabled = false;
    }
  }

  const sso = h("div", { class: "sso", id: "sso-offer", hidden: true });
  ssoOffer(sso, after);
  replace(root,
    h("div", { class: "card login-card" },
      h("h1", {}, "torchyard"),
      message,
      sso,
      form,
      h("p", { class: "muted small" },
        "Run ", h("code", {}, "torchyard ui"), " for a link that logs you in, or paste a token from ",
        h("code", {}, "torchyard token create --user NAME"), ". The page keeps the login in an HttpOnly cookie, never the token.")));
  input.focus();
  return null;
}
