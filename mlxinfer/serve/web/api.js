// This server's own APIs, with the API key when it asks for one (asked once, kept in
// sessionStorage: gone when the tab closes).

const KEY = "mlxinfer.key";
let askKey = null; // set by the page: () => Promise<string>, shows the key dialog

export function onKeyNeeded(ask) { askKey = ask; }

function headers() {
  const key = sessionStorage.getItem(KEY);
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

export class ApiError extends Error {}

// Ask for the key before the first call when the server says it wants one (/health is open to
// all), so the page's first request is not a 401.
export async function ready() {
  const health = await (await fetch("/health")).json();
  if (health.api_key_required && !sessionStorage.getItem(KEY) && askKey) sessionStorage.setItem(KEY, await askKey());
  return health;
}

// fetch(path), asking for the key and retrying when the server answers 401.
async function call(path, init = {}) {
  for (;;) {
    const response = await fetch(path, { ...init, headers: headers() });
    if (response.status !== 401 || !askKey) return response;
    sessionStorage.setItem(KEY, await askKey());
  }
}

async function failure(response) {
  const body = await response.json().catch(() => ({}));
  return new ApiError(body?.error?.message ?? `${response.status} ${response.statusText}`);
}

export async function getJSON(path) {
  const response = await call(path);
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function postJSON(path, body, signal) {
  const response = await call(path, { method: "POST", body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// POST a streamed chat completion; calls onEvent(data) for each Server-Sent Event's JSON, in
// order, until [DONE]. `signal` aborts it: the server sees the connection close and frees
// the request's slot.
export async function stream(body, onEvent, signal) {
  const response = await call("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) throw new ApiError(parsed.error.message);
      onEvent(parsed);
    }
  }
}
