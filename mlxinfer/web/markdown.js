// Markdown to DOM nodes, small and safe: every piece of text becomes a text node (never HTML),
// links keep only http(s) and mailto addresses. Covers what chat replies use: fenced code
// blocks (with a copy button), headings, lists, quotes, rules, paragraphs, and inline code,
// bold, italic and links.

import { el } from "./dom.js";

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(([^)\s]+)\)/;

function inline(text) {
  const out = [];
  while (text) {
    const m = INLINE.exec(text);
    if (!m) { out.push(document.createTextNode(text)); break; }
    if (m.index) out.push(document.createTextNode(text.slice(0, m.index)));
    if (m[1]) out.push(el("code", { textContent: m[2] }));
    else if (m[3] || m[4]) out.push(el("strong", {}, ...inline(m[3] || m[4])));
    else if (m[5] || m[6]) out.push(el("em", {}, ...inline(m[5] || m[6])));
    else out.push(link(m[7], m[8]));
    text = text.slice(m.index + m[0].length);
  }
  return out;
}

function link(label, href) {
  if (!/^(https?:|mailto:)/i.test(href)) return document.createTextNode(`[${label}](${href})`);
  return el("a", { href, target: "_blank", rel: "noopener noreferrer" }, ...inline(label));
}

function codeBlock(lang, code) {
  const copy = el("button", { type: "button", className: "copy", textContent: "Copy" });
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code).then(() => { copy.textContent = "Copied"; }));
  const pre = el("pre", {}, el("code", { textContent: code }));
  if (lang) pre.dataset.lang = lang;
  return el("div", { className: "code" }, copy, pre);
}

const LIST_ITEM = /^(\s*)([-*+]|\d+[.)])\s+(.*)$/;

// The node list for `source` (rendered as it streams: an unclosed code fence runs to the end).
export function markdown(source) {
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  const flush = () => { if (para.length) out.push(el("p", {}, ...inline(para.join("\n")))); para = []; };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = /^\s*(```+|~~~+)\s*([\w+-]*)/.exec(line);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i++) body.push(lines[i]);
      out.push(codeBlock(fence[2], body.join("\n")));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) { flush(); out.push(el(`h${Math.min(heading[1].length + 2, 6)}`, {}, ...inline(heading[2]))); continue; }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.push(el("hr")); continue; }
    if (/^\s*>/.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && /^\s*>/.test(lines[i]); i++) quoted.push(lines[i].replace(/^\s*>\s?/, ""));
      i--;
      out.push(el("blockquote", {}, ...markdown(quoted.join("\n"))));
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      flush();
      const ordered = /\d/.test(item[2]);
      const list = el(ordered ? "ol" : "ul");
      for (; i < lines.length; i++) {
        const m = LIST_ITEM.exec(lines[i]);
        if (m) list.append(el("li", {}, ...inline(m[3])));
        else if (lines[i].trim() && /^\s+/.test(lines[i]) && list.lastChild) list.lastChild.append(" ", ...inline(lines[i].trim()));
        else break;
      }
      i--;
      out.push(list);
      continue;
    }
    if (!line.trim()) { flush(); continue; }
    para.push(line);
  }
  flush();
  return out;
}
