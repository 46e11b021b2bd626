// Conversations and settings, kept in the browser's localStorage (nothing leaves the browser).
// A conversation: {id, title, created, messages: [{role, content, reasoning?, look?}]}, where a
// reply's `look` is what "Look inside" shows: the request sent, stats, token logprobs, timeline.

const CONVERSATIONS = "mlxinfer.conversations";
const SETTINGS = "mlxinfer.settings";

function read(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}

export function loadConversations() { return read(CONVERSATIONS, []); }

export function saveConversations(conversations) {
  try { localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations)); } catch (e) {
    // full storage: keep the text, drop what Look inside recorded of older replies
    for (const c of conversations) for (const m of c.messages) delete m.look;
    localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
  }
}

export function newConversation() {
  return { id: crypto.randomUUID?.() ?? String(Date.now() + Math.random()), title: "New chat", created: Date.now(), messages: [] };
}

export function loadSettings() { return read(SETTINGS, {}); }
export function saveSettings(settings) { localStorage.setItem(SETTINGS, JSON.stringify(settings)); }

// The conversations as a JSON file the browser downloads (made here: no request is sent).
export function exportConversations(conversations) {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `mlxinfer-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}
