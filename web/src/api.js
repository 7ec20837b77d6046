// The page's one way to the API: same-origin fetch with the session cookie (never a token
// the page keeps), the CSRF token on every change, and the API's error shape.

let csrf = null;
let skewMs = 0; // server clock minus ours, from the Date header (1 s resolution)
let onUnauthorized = () => {};

export function setCsrf(token) { csrf = token; }
export function whenUnauthorized(fn) { onUnauthorized = fn; }
export function serverNow() { return Date.now() + skewMs; }

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code;
    this.details = err.details;
  }
}

function noteClock(r) {
  const date = Date.parse(r.headers.get("date") || "");
  if (!Number.isNaN(date)) {
    const skew = date - Date.now();
    skewMs = Math.abs(skew) > 2000 ? skew : 0;
  }
}

export async function api(path, { method = "GET", body, headers = {}, signal, quiet = false } = {}) {
  const h = { Accept: "application/json", ...headers };
  if (body !== undefined) h["Content-Type"] = "application/json";
  if (!["GET", "HEAD"].includes(method) && csrf) h["X-CSRF-Token"] = csrf;
  const r = await fetch(path, {
    method,
    headers: h,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
    cache: "no-store",
    signal,
  });
  noteClock(r);
  if (r.status === 204) return null;
  let data = null;
  try { data = await r.json(); } catch { data = null; }
  if (!r.ok) {
    if (r.status === 401 && !quiet) onUnauthorized();
    throw new ApiError(r.status, data);
  }
  return data;
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v == null || v === "") continue;
    for (const item of Array.isArray(v) ? v : [v]) q.append(k, String(item));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

// A server-sent event stream: `handlers` by event name, each given the parsed data.
export function stream(url, handlers, { onOpen } = {}) {
  const es = new EventSource(url, { withCredentials: true });
  for (const [event, fn] of Object.entries(handlers)) {
    es.addEventListener(event, (e) => {
      let data = null;
      try { data = e.data ? JSON.parse(e.data) : null; } catch { return; }
      fn(data, e);
    });
  }
  if (onOpen) es.addEventListener("open", onOpen);
  return es;
}

export function jobPath(id) { return `/v1/jobs/${encodeURIComponent(id)}`; }
