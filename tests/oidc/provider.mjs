// A real OpenID provider for torchyard's single sign-on tests: node-oidc-provider (OpenID
// Certified), configured here and nowhere else. Only its login and consent pages are ours
// (the library leaves those to its user): a form that takes a user name, and consent given
// at once, as a company's own provider does for its own tools.
//
//   node provider.mjs CONFIG.json
//
// CONFIG: {"host", "issuer" ("{port}" is replaced by the port it listens on), "users"
// (a JSON file read on every request, so a test removes a user by rewriting it:
// {"alice": {"sub": "…", "groups": ["…"], "email": "…"}}), "clients": [{client_id,
// client_secret, redirect_uris}], "port" (0: any free one)}. Prints one JSON line,
// {"issuer", "port"}, once it serves.
import { generateKeyPairSync, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import http from "node:http";
import Provider from "oidc-provider";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code";

function users() {
  try {
    return JSON.parse(readFileSync(config.users, "utf8"));
  } catch {
    return {};
  }
}

function byName(name) {
  const user = users()[name];
  return user ? { name, ...user } : undefined;
}

function bySub(sub) {
  const found = Object.entries(users()).find(([, u]) => u.sub === sub);
  return found ? { name: found[0], ...found[1] } : undefined;
}

// A user removed from the file is no account: the provider refuses its codes and tokens.
async function findAccount(ctx, sub) {
  const user = bySub(sub);
  if (!user) return undefined;
  return {
    accountId: sub,
    async claims() {
      return {
        sub,
        preferred_username: user.name,
        name: user.display_name || user.name,
        email: user.email || `${user.name}@example.test`,
        email_verified: true,
        groups: user.groups || [],
      };
    },
  };
}

function signingKey() {
  const { privateKey } = generateKeyPairSync("rsa", { modulusLength: 2048 });
  return { ...privateKey.export({ format: "jwk" }), kid: randomBytes(8).toString("hex"), use: "sig", alg: "RS256" };
}

function configuration() {
  return {
    clients: config.clients.map((c) => ({
      client_id: c.client_id,
      client_secret: c.client_secret,
      redirect_uris: c.redirect_uris,
      grant_types: ["authorization_code", DEVICE_GRANT],
      response_types: ["code"],
      token_endpoint_auth_method: "client_secret_basic",
    })),
    // Every client must send a PKCE challenge, confidential ones too.
    pkce: { required: () => true },
    features: { devInteractions: { enabled: false }, deviceFlow: { enabled: true } },
    claims: {
      openid: ["sub"],
      profile: ["preferred_username", "name"],
      email: ["email", "email_verified"],
      groups: ["groups"],
    },
    scopes: ["openid", "profile", "email", "groups"],
    findAccount,
    interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
    jwks: { keys: [signingKey()] },
    cookies: { keys: [randomBytes(32).toString("hex")] },
  };
}

const escape = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function loginPage(uid, clientId, error) {
  return `<!doctype html><meta charset="utf-8"><title>Test provider: sign in</title>
<h1>Sign in to the test provider</h1><p>for <b id="client">${escape(clientId)}</b></p>
${error ? `<p id="error">${escape(error)}</p>` : ""}
<form method="post" action="/interaction/${escape(uid)}/login">
<label>User name <input name="login" id="login" autofocus></label>
<button type="submit" id="sign-in">Sign in</button></form>
<form method="post" action="/interaction/${escape(uid)}/abort"><button type="submit" id="abort">Cancel</button></form>`;
}

async function formBody(req) {
  let body = "";
  for await (const chunk of req) body += chunk;
  return new URLSearchParams(body);
}

// Consent is given at once: every scope and claim the client asked for.
async function consent(provider, details) {
  const { prompt, params, session, grantId } = details;
  const grant = grantId
    ? await provider.Grant.find(grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  const missing = prompt.details;
  if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(" "));
  if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
  if (missing.missingResourceScopes) {
    for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes)) {
      grant.addResourceScope(indicator, scopes.join(" "));
    }
  }
  return { consent: { grantId: await grant.save() } };
}

async function interaction(provider, req, res) {
  const [, , uid, action] = new URL(req.url, "http://x").pathname.split("/");
  const details = await provider.interactionDetails(req, res);
  if (details.uid !== uid) throw new Error("interaction mismatch");
  if (req.method === "GET" && details.prompt.name === "consent") {
    return provider.interactionFinished(req, res, await consent(provider, details), { mergeWithLastSubmission: true });
  }
  if (req.method === "GET") {
    res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    return res.end(loginPage(uid, details.params.client_id));
  }
  if (action === "abort") {
    return provider.interactionFinished(req, res, { error: "access_denied", error_description: "the user cancelled the sign-in" });
  }
  const user = byName(((await formBody(req)).get("login") || "").trim());
  if (!user) {
    return provider.interactionFinished(req, res, { error: "access_denied", error_description: "no such user at the provider" });
  }
  return provider.interactionFinished(req, res, { login: { accountId: user.sub } }, { mergeWithLastSubmission: false });
}

const server = http.createServer();
server.listen(config.port || 0, config.host || "127.0.0.1", () => {
  const { port } = server.address();
  const issuer = config.issuer.replace("{port}", String(port));
  const provider = new Provider(issuer, configuration());
  const callback = provider.callback();
  server.on("request", (req, res) => {
    if (!req.url.startsWith("/interaction/")) return callback(req, res);
    interaction(provider, req, res).catch((e) => {
      res.writeHead(400, { "content-type": "text/plain" });
      res.end(`interaction failed: ${e.message}`);
    });
  });
  process.stdout.write(`${JSON.stringify({ issuer, port })}\n`);
});
process.on("SIGTERM", () => server.close(() => process.exit(0)));
