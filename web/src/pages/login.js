// The login page: paste an API token (sent once, in a header, to open a session; never
// stored), or come back through `torchyard ui`'s one-time link.
import { api } from "../api.js";
import { h, replace } from "../dom.js";

export function loginPage(root, { error, onLogin }) {
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

  replace(root,
    h("div", { class: "card login-card" },
      h("h1", {}, "torchyard"),
      message,
      form,
      h("p", { class: "muted small" },
        "Run ", h("code", {}, "torchyard ui"), " for a link that logs you in, or paste a token from ",
        h("code", {}, "torchyard token create --user NAME"), ". The page keeps the login in an HttpOnly cookie, never the token.")));
  input.focus();
  return null;
}
