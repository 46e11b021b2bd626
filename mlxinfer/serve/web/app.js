// The chat page: conversations (localStorage), streaming replies from /v1/chat/completions,
// Stop, regenerate, edit, settings, and "Look inside" each reply (inspect.js).

import { ApiError, getJSON, onKeyNeeded, ready, stream } from "./api.js";
import { lookInside } from "./inspect.js";
import { MarkdownView, markdown } from "./markdown.js";
import { el } from "./dom.js";
import { exportConversations, loadConversations, loadSettings, newConversation, saveConversations, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);

const TOP_LOGPROBS = 5;
let model = "default";
let conversations = loadConversations();
let current = conversations[0] ?? null;
let settings = loadSettings();
let running = null; // {controller, message} while a reply streams

// --- the API key: asked when the server answers 401, and asked again after the dialog is dismissed ---
let keyAsked = null;
onKeyNeeded(() => {
  keyAsked ??= new Promise((resolve, reject) => {
    const dialog = $("key-dialog");
    const form = $("key-form");
    dialog.returnValue = "";
    // "close" follows a submit and Esc alike (Esc sends no submit): settling here leaves no
    // caller waiting forever, and clearing keyAsked makes the next 401 ask again.
    dialog.addEventListener("close", () => {
      const key = form.key.value;
      keyAsked = null;
      form.reset();
      if (dialog.returnValue === "use") resolve(key);
      else reject(new ApiError("this server needs an API key: the next message sent asks for it again"));
    }, { once: true });
    dialog.showModal();
  });
  return keyAsked;
});

// --- conversations ---
function save() { saveConversations(conversations); }

function select(conversation) {
  current = conversation;
  renderList();
  renderMessages();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren(...conversations.map((c) => {
    const open = el("button", { type: "button", className: "title", textContent: c.title });
    if (c === current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => { if (!running) select(c); });
    const rename = el("button", { type: "button", textContent: "Rename", className: "small" });
    rename.setAttribute("aria-label", `Rename ${c.title}`);
    rename.addEventListener("click", () => {
      const input = el("input", { value: c.title, className: "title" });
      input.setAttribute("aria-label", "Conversation name");
      const done = () => { c.title = input.value.trim() || c.title; save(); renderList(); };
      input.addEventListener("keydown", (e) => { if (e.key === "Enter") done(); if (e.key === "Escape") renderList(); });
      input.addEventListener("blur", done);
      open.replaceWith(input);
      input.select();
    });
    const remove = el("button", { type: "button", textContent: "Delete", className: "small" });
    remove.setAttribute("aria-label", `Delete ${c.title}`);
    remove.addEventListener("click", () => {
      if (running) return;
      conversations = conversations.filter((x) => x !== c);
      save();
      select(current === c ? conversations[0] ?? null : current);
    });
    return el("li", {}, open, rename, remove);
  }));
}

// --- messages ---
function renderMessages() {
  const box = $("messages");
  const messages = current?.messages ?? [];
  box.replaceChildren(...messages.map((m, i) => article(m, i, i === messages.length - 1)));
}

function article(message, index, last) {
  const node = el("article", { className: `msg ${message.role}` });
  node.setAttribute("aria-label", message.role === "user" ? "You" : "Assistant");
  if (message.role === "user") {
    const content = el("div", { className: "content" }, markdown(message.content));
    const edit = el("button", { type: "button", textContent: "Edit", className: "small" });
    edit.addEventListener("click", () => editMessage(node, content, index));
    node.append(content, el("div", { className: "actions" }, edit));
    return node;
  }
  node.append(...replyParts(message));
  const actions = el("div", { className: "actions" });
  const copy = el("button", { type: "button", textContent: "Copy", className: "small" });
  copy.addEventListener("click", () => navigator.clipboard?.writeText(message.content));
  actions.append(copy);
  if (last) {
    const again = el("button", { type: "button", textContent: "Regenerate", className: "small" });
    again.addEventListener("click", () => { if (!running) { current.messages.pop(); reply(); } });
    actions.append(again);
  }
  if (message.look) {
    const panel = el("div", { className: "look", hidden: true });
    const look = el("button", { type: "button", textContent: "Look inside", className: "small" });
    look.setAttribute("aria-expanded", "false");
    look.addEventListener("click", () => {
      const open = panel.hidden;
      panel.hidden = !open;
      look.setAttribute("aria-expanded", String(open));
      if (open && !panel.firstChild) lookInside(panel, message, current.messages.slice(0, index), onError);
    });
    actions.append(look);
    node.append(actions, panel);
  } else node.append(actions);
  return node;
}

// The reasoning (folded), the answer, and the stats line of a reply.
function replyParts(message) {
  const parts = [];
  if (message.reasoning) parts.push(reasoningBox(markdown(message.reasoning)));
  parts.push(el("div", { className: "content" }, markdown(message.content)));
  const stats = statsLine(message.look);
  if (stats) parts.push(el("p", { className: "stats", textContent: stats }));
  return parts;
}

function reasoningBox(...children) {
  return el("details", { className: "reasoning" }, el("summary", { textContent: "Reasoning" }), el("div", {}, ...children));
}

// A reply's parts drawn while it streams (`node`: its article, as article() made it): the text is
// appended piece by piece and each paint redraws only what changed (markdown.js keeps the blocks that
// are finished), so a long reply costs each frame about its last block, not its whole length.
function streamingReply(node, message) {
  const content = node.querySelector(".content");
  const answer = new MarkdownView(content);
  const stats = el("p", { className: "stats", hidden: true });
  content.after(stats);
  let thinking = null; // the reasoning's view, from its first piece
  return {
    append(text, reasoning) {
      if (reasoning && !thinking) {
        const box = reasoningBox();
        content.before(box);
        thinking = new MarkdownView(box.lastChild);
      }
      if (reasoning) thinking.append(reasoning);
      if (text) answer.append(text);
    },
    paint() {
      answer.render();
      thinking?.render();
      stats.textContent = statsLine(message.look);
      stats.hidden = !stats.textContent;
    },
  };
}

function statsLine(look) {
  const t = look?.timings;
  const u = look?.usage;
  if (!t && !u) return look?.stopped ? "stopped" : "";
  const parts = [];
  if (t) {
    parts.push(`TTFT ${t.prompt_ms.toFixed(0)} ms`, `prefill ${t.prompt_per_second.toFixed(1)} tok/s`,
      `decode ${t.predicted_per_second.toFixed(1)} tok/s`);
  }
  if (u) parts.push(`${u.completion_tokens} tokens`, `${u.prompt_tokens} prompt`, `${u.prompt_tokens_details?.cached_tokens ?? 0} cached`);
  if (t?.draft_n) parts.push(`drafts accepted ${t.draft_n_accepted}/${t.draft_n} (${(100 * t.draft_n_accepted / t.draft_n).toFixed(0)}%)`);
  if (look.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function editMessage(node, content, index) {
  if (running) return;
  const box = el("textarea", { value: current.messages[index].content, rows: 3 });
  box.setAttribute("aria-label", "Edit message");
  const send = el("button", { type: "button", textContent: "Save and send" });
  const cancel = el("button", { type: "button", textContent: "Cancel" });
  const form = el("div", { className: "edit" }, box, send, cancel);
  content.replaceWith(form);
  box.focus();
  cancel.addEventListener("click", renderMessages);
  send.addEventListener("click", () => {
    if (!box.value.trim()) return;
    current.messages = [...current.messages.slice(0, index), { role: "user", content: box.value }];
    reply();
  });
}

// --- settings ---
const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];
const INTEGERS = new Set(["top_k", "max_tokens", "seed"]);

function showSettings() {
  const form = $("settings");
  for (const name of ["system", "json_schema", ...NUMBERS]) form.elements[name].value = settings[name] ?? "";
}

function readSettings() {
  const form = $("settings");
  settings = Object.fromEntries([...new FormData(form)].filter(([, v]) => v !== ""));
  saveSettings(settings);
}

// The request body's sampling fields, from the settings (an empty field: the server's default).
function sampling() {
  const out = {};
  for (const name of NUMBERS) {
    if (settings[name] === undefined) continue;
    out[name] = INTEGERS.has(name) ? parseInt(settings[name], 10) : parseFloat(settings[name]);
  }
  if (settings.json_schema) {
    let schema;
    try { schema = JSON.parse(settings.json_schema); } catch (e) { throw new ApiError(`the JSON schema is not valid JSON: ${e.message}`); }
    out.response_format = { type: "json_schema", json_schema: { name: "reply", schema } };
  }
  return out;
}

// --- a reply ---
function onError(e) { $("error").textContent = e instanceof ApiError ? e.message : String(e); }

function setRunning(value) {
  running = value;
  $("stop").hidden = !value;
  $("send").disabled = !!value;
}

async function reply() {
  $("error").textContent = "";
  const history = current.messages.map(({ role, content }) => ({ role, content }));
  const system = settings.system ? [{ role: "system", content: settings.system }] : [];
  let body;
  try {
    // return_token_details (the server's extension): each token's id and whether it was drafted
    body = { model, messages: [...system, ...history], stream: true, stream_options: { include_usage: true },
      logprobs: true, top_logprobs: TOP_LOGPROBS, return_token_details: true, ...sampling() };
  } catch (e) { onError(e); return; }
  const message = { role: "assistant", content: "", reasoning: "", look: { request: { ...body, messages: undefined, return_token_details: undefined }, system: settings.system, tokens: [], times: [] } };
  current.messages.push(message);
  save();
  renderMessages();
  const view = streamingReply($("messages").lastElementChild, message);
  const controller = new AbortController();
  setRunning({ controller, message });
  const start = performance.now();
  let queued = false;
  const paint = () => {
    queued = false;
    view.paint();
  };
  try {
    await stream(body, (event) => {
      const choice = event.choices?.[0];
      if (choice) {
        const text = choice.delta?.content ?? "";
        const reasoning = choice.delta?.reasoning_content ?? "";
        message.content += text;
        message.reasoning += reasoning;
        view.append(text, reasoning);
        const details = choice.token_details ?? [];
        for (const [i, token] of (choice.logprobs?.content ?? []).entries()) {
          message.look.tokens.push({ ...token, id: details[i]?.id, drafted: details[i]?.drafted });
          message.look.times.push(performance.now() - start);
        }
        if (choice.finish_reason) message.look.finish = choice.finish_reason;
      }
      if (event.usage) message.look.usage = event.usage;
      if (event.timings) message.look.timings = event.timings;
      if (!queued) { queued = true; requestAnimationFrame(paint); }
    }, controller.signal);
  } catch (e) {
    if (e.name === "AbortError") message.look.stopped = true;
    else {
      onError(e);
      if (!message.content && !message.look.tokens.length) current.messages.pop(); // refused: no reply to keep
    }
  } finally {
    setRunning(null);
    if (current.title === "New chat" && current.messages[0]) current.title = current.messages[0].content.slice(0, 40);
    save();
    renderList();
    renderMessages();
    $("message").focus();
  }
}

function send() {
  const box = $("message");
  const text = box.value;
  if (!text.trim() || running) return;
  if (!current) { current = newConversation(); conversations.unshift(current); }
  current.messages.push({ role: "user", content: text });
  box.value = "";
  reply();
}

function stop() { running?.controller.abort(); }

// --- wiring ---
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
// Esc stops a reply, except while the key dialog is open: there Esc dismisses the dialog.
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && running && !$("key-dialog").open) { e.preventDefault(); stop(); }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  if (running) return;
  const c = newConversation();
  conversations.unshift(c);
  save();
  select(c);
  $("message").focus();
});
$("export").addEventListener("click", () => exportConversations(conversations));
$("settings-toggle").addEventListener("click", () => {
  const form = $("settings");
  form.hidden = !form.hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!form.hidden));
});
$("settings").addEventListener("input", readSettings);
$("settings").addEventListener("submit", (e) => e.preventDefault());

showSettings();
renderList();
renderMessages();
ready().then(() => getJSON("/v1/models")).then((r) => {
  model = r.data[0]?.id ?? model;
  $("model").textContent = model;
  document.body.dataset.ready = "true";
}).catch(onError);
