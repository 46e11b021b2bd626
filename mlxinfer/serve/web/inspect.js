// "Look inside" a reply: its tokens (the prompt's, marked where they came from the prompt
// cache, and the reply's with their probability and top alternatives from `logprobs`, their
// ids and drafted marks from `token_details`), the pipeline that made it (the stages
// `mlxinfer inspect` reports, via /v1/inspect, the sampler settings sent, and a timeline of
// the prefill chunk by chunk, from `timings.prompt_chunks`, and the decode steps), and on
// demand the attention of its last token over the context in one layer and head (/v1/attention).

import { postJSON } from "./api.js";
import { el } from "./dom.js";

const percent = (p) => `${(100 * p).toFixed(p >= 0.995 || p < 0.0005 ? 0 : 1)}%`;
const visible = (text) => text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";

function region(name) {
  const section = el("section", { className: "region" }, el("h3", { textContent: name }));
  section.setAttribute("aria-label", name);
  return section;
}

function list(name) {
  const ol = el("ol", { className: "chips" });
  ol.setAttribute("aria-label", name);
  return ol;
}

// panel: where to draw; message: the reply; history: the messages before it; onError: shows a failure.
export function lookInside(panel, message, history, onError) {
  const look = message.look;
  const prompt = [...(look.system ? [{ role: "system", content: look.system }] : []),
    ...history.map(({ role, content }) => ({ role, content }))];
  panel.append(tokensRegion(look, prompt, onError), pipelineRegion(look, prompt, onError, panel),
    attentionRegion(message, prompt, onError, panel));
}

function tokensRegion(look, prompt, onError) {
  const section = region("Tokens");
  const detail = el("p", { className: "detail", textContent: "Select a token for its probability and alternatives." });
  detail.setAttribute("aria-live", "polite");
  const prompts = list("Prompt tokens");
  const replies = list("Reply tokens");
  replies.append(...look.tokens.map((t) => {
    const p = Math.exp(t.logprob);
    const item = el("li", { className: t.drafted ? "chip drafted" : "chip", tabIndex: 0 },
      el("span", { className: "text", textContent: visible(t.token) }), el("span", { className: "p", textContent: percent(p) }));
    item.dataset.logprob = String(t.logprob);
    if (t.id !== undefined) item.dataset.id = String(t.id);
    item.dataset.drafted = String(Boolean(t.drafted));
    item.style.setProperty("--p", String(p));
    const alternatives = (t.top_logprobs ?? []).map((a) => `${JSON.stringify(a.token)} ${percent(Math.exp(a.logprob))}`).join(", ");
    const id = t.id !== undefined ? ` id ${t.id}` : "";
    item.title = `${JSON.stringify(t.token)}${id}: p ${percent(p)} (logprob ${t.logprob.toFixed(4)})${t.drafted ? "; drafted and accepted" : ""}`;
    const show = () => { detail.textContent = `${item.title}; top alternatives: ${alternatives || "none"}`; };
    item.addEventListener("click", show);
    item.addEventListener("focus", show);
    return item;
  }));
  const cached = look.usage?.prompt_tokens_details?.cached_tokens ?? 0;
  const drafted = look.tokens.filter((t) => t.drafted).length;
  const legend = el("p", { className: "legend", textContent:
    `Prompt: ${look.usage?.prompt_tokens ?? "?"} tokens, ${cached} from the prompt cache (marked); reply: ${look.tokens.length} tokens, each with its probability, ${drafted} drafted and accepted (marked). Ids on hover.` });
  section.append(legend, el("h4", { textContent: "Prompt" }), prompts, el("h4", { textContent: "Reply" }), replies, detail);
  postJSON("/tokenize", { model: look.request.model, messages: prompt, with_pieces: true }).then((r) => {
    prompts.append(...r.tokens.map((t, i) => {
      const item = el("li", { className: i < cached ? "chip cached" : "chip", title: `id ${t.id}${i < cached ? " (from the prompt cache)" : ""}` },
        el("span", { className: "text", textContent: visible(t.piece) }));
      item.dataset.id = String(t.id);
      return item;
    }));
  }).catch(onError);
  return section;
}

function pipelineRegion(look, prompt, onError, panel) {
  const section = region("Pipeline");
  const sampler = Object.entries(look.request).filter(([k, v]) => v !== undefined && !["model", "stream", "stream_options"].includes(k))
    .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ");
  const stages = el("ol", { className: "stages" }, el("li", { textContent: "Running the prompt through the model…" }));
  stages.setAttribute("aria-label", "Stages");
  section.append(stages, el("p", { className: "legend", textContent: `Sampler: ${sampler || "the server's defaults"}` }), timeline(look));
  postJSON("/v1/inspect", { model: look.request.model, messages: prompt }).then((r) => {
    stages.replaceChildren(...stageItems(r, look));
    panel.dispatchEvent(new CustomEvent("inspected", { detail: r }));
  }).catch((e) => { stages.replaceChildren(el("li", { textContent: `Not available: ${e.message}` })); });
  return section;
}

function stageItems(r, look) {
  const lay = r.layers;
  const kv = r.kv_cache;
  const total = (look.usage?.prompt_tokens ?? kv.prompt_tokens) + look.tokens.length;
  const mixers = Object.entries(lay.recurrent ?? {}).map(([k, n]) => `, ${k} in ${n}`).join("");
  const window = lay.sliding_window_layers ? `; ${lay.sliding_window_layers} layers see a window of ${lay.sliding_window}` : "";
  const top = r.steps[0]?.top.map((e) => `${JSON.stringify(e.text)} ${percent(e.p)}`).join(", ");
  return [
    `Tokenizer: the chat template renders the messages, which become ${r.tokens.length} tokens.`,
    `Embedding: a ${r.embedding.shape.join(" × ")} matrix (${r.embedding.stored}) turns them into a ${r.embedding.output_shape.join(" × ")} array.`,
    `Layers: ${lay.count}, each ${lay.attention} attention${mixers} with ${lay.heads} query heads, ${lay.kv_heads} KV heads of ${lay.head_dim} dims${window}; MLP ${lay.mlp}; RoPE θ ${lay.rope.theta}; LM head ${lay.lm_head}.`,
    `KV cache: ${kv.bytes_per_token.toLocaleString()} bytes per token (${kv.dtype}): ${size(kv.bytes_per_token * total)} for this reply's ${total} tokens.`,
    `Prefill (rerun now): ${r.timing.prefill_tokens} tokens in ${(1000 * r.timing.prefill_s).toFixed(0)} ms; the next token's most likely choices: ${top}.`,
  ].map((text) => el("li", { textContent: text }));
}

function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  for (; bytes >= 1024 && i < units.length - 1; i++) bytes /= 1024;
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// The prefill chunk by chunk as the server ran it (`timings.prompt_chunks`: tokens, start and
// time of each), then each decode step as the page received its token (drafted ones marked),
// on one time axis from the request.
function timeline(look) {
  const times = look.times;
  const t = look.timings;
  const chunks = t?.prompt_chunks ?? [];
  const box = el("figure", { className: "timeline" });
  if (!times.length) { box.append(el("figcaption", { textContent: "No token arrived." })); return box; }
  const end = Math.max(times[times.length - 1], ...chunks.map((c) => c.start_ms + c.ms)) || 1;
  const at = (node, from, width) => {
    node.style.left = `${(100 * from) / end}%`;
    if (width !== undefined) node.style.width = `${Math.max((100 * width) / end, 0.3)}%`;
    return node;
  };
  const bar = el("ol", { className: "bar" });
  bar.setAttribute("aria-label", "Timeline");
  bar.append(...chunks.map((c, i) => {
    const item = at(el("li", { className: "prefill", title: `prefill chunk ${i + 1}: ${c.n} tokens in ${c.ms.toFixed(1)} ms` }), c.start_ms, c.ms);
    item.dataset.n = String(c.n);
    item.dataset.ms = String(c.ms);
    return item;
  }), ...times.slice(1).map((time, i) => {
    const drafted = look.tokens[i + 1]?.drafted;
    const item = at(el("li", { className: drafted ? "step drafted" : "step",
      title: `decode step ${i + 1}: ${(time - times[i]).toFixed(1)} ms${drafted ? " (drafted and accepted)" : ""}` }), time);
    item.dataset.drafted = String(Boolean(drafted));
    return item;
  }));
  const steps = times.length - 1;
  const mean = steps ? (times[times.length - 1] - times[0]) / steps : 0;
  const sizes = chunks.map((c) => `${c.n} (${c.ms.toFixed(0)} ms)`).join(" + ");
  const prefillText = t ? `prefill ${t.prompt_n} tokens (${t.cache_n} from the cache) in ${chunks.length} chunk${chunks.length === 1 ? "" : "s"}${sizes ? ` of ${sizes}` : ""}, the last prompt token with the first decode step; first token after ${t.prompt_ms.toFixed(0)} ms` : `first token after ${times[0].toFixed(0)} ms`;
  box.append(bar, el("figcaption", { textContent: `Timeline: ${prefillText}; then ${steps} decode steps, ${mean.toFixed(1)} ms each on average (as this page received them).` }));
  return box;
}

function attentionRegion(message, prompt, onError, panel) {
  const section = region("Attention");
  const layer = el("select", {});
  layer.setAttribute("aria-label", "Layer");
  const head = el("select", {});
  head.setAttribute("aria-label", "Head");
  const show = el("button", { type: "button", textContent: "Show attention", disabled: true });
  const strip = el("ol", { className: "heat" });
  strip.setAttribute("aria-label", "Attention weights");
  const note = el("p", { className: "legend", textContent: "The last token's attention over the context, in one layer and head, computed by the server on request." });
  section.append(note, el("div", { className: "row" }, layer, head, show), strip);
  panel.addEventListener("inspected", (e) => {
    const lay = e.detail.layers;
    layer.replaceChildren(...Array.from({ length: lay.count }, (_, i) => el("option", { value: i, textContent: `layer ${i}` })));
    head.replaceChildren(...Array.from({ length: lay.heads }, (_, i) => el("option", { value: i, textContent: `head ${i}` })));
    show.disabled = false;
  }, { once: true });
  show.addEventListener("click", () => {
    show.disabled = true;
    postJSON("/v1/attention", { model: message.look.request.model, messages: prompt, reply: message.content, layer: Number(layer.value), head: Number(head.value) })
      .then((r) => {
        const top = Math.max(...r.weights) || 1;
        strip.replaceChildren(...r.tokens.map((t, i) => {
          const item = el("li", { className: "chip", title: `id ${t.id}: weight ${r.weights[i].toFixed(4)}` },
            el("span", { className: "text", textContent: visible(t.text) }));
          item.dataset.weight = String(r.weights[i]);
          item.style.setProperty("--w", String(r.weights[i] / top));
          return item;
        }));
      })
      .catch((e) => { strip.replaceChildren(el("li", { textContent: `Not available: ${e.message}` })); })
      .finally(() => { show.disabled = false; });
  });
  return section;
}
