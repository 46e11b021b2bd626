// Markdown to DOM nodes, small and safe: every piece of text becomes a text node (never HTML), links
// keep only http(s) and mailto addresses. The blocks come from blocks.js (CommonMark's), their text
// from inline.js; code blocks get a copy button, and headings sit two levels down (the page has its own).
//
// A reply arrives in pieces: MarkdownView draws a growing text incrementally. Each complete line is
// parsed once; a block that is finished keeps its DOM nodes; a frame redraws only the blocks still open
// and the last, unfinished line (parsed provisionally, then undone). A reply of N characters streamed in
// K frames costs O(N) plus the open block's size per frame, not O(N·K).

import { BlockParser } from "./blocks.js";
import { el } from "./dom.js";
import { inline } from "./inline.js";

// The DOM kept for a container block while it is drawn: its element, and how many of its leading
// children are settled (final, drawn, never drawn again) in the tightness they were drawn in.
const drawn = new WeakMap();

function codeBlock(lang, code) {
  const copy = el("button", { type: "button", className: "copy", textContent: "Copy" });
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code).then(() => { copy.textContent = "Copied"; }));
  const pre = el("pre", {}, el("code", { textContent: code }));
  if (lang) pre.dataset.lang = lang;
  return el("div", { className: "code" }, copy, pre);
}

// The DOM of `block`: a new node for a leaf (a fragment of inline nodes for a paragraph in a tight list
// item), the kept element of a container, its children brought up to date.
function draw(block, tight) {
  switch (block.type) {
    case "paragraph": {
      const content = inline(block.lines.join("\n").trim());
      return tight ? content : el("p", {}, content);
    }
    case "heading":
      return el(`h${Math.min(block.level + 2, 6)}`, {}, inline(block.lines.join("\n").trim()));
    case "hr":
      return el("hr");
    case "code":
      return codeBlock(block.lang, block.lines.join("\n"));
    case "quote":
      return drawContainer(block, () => el("blockquote"), false);
    case "list":
      return drawContainer(block, () => (block.ordered ? el("ol", block.start === 1 ? {} : { start: block.start }) : el("ul")),
        !block.loose);
    default: // item
      return drawContainer(block, () => el("li"), tight);
  }
}

// A container's element (made by `make` the first time), its children brought up to date: the leading children
// that are final and were drawn in the same tightness are kept as they are (never redrawn); the rest are
// drawn again, an open container among them keeping its element where it is.
function drawContainer(block, make, tight) {
  let view = drawn.get(block);
  if (!view) drawn.set(block, (view = { element: make(), tight, settled: 0, last: null }));
  const element = view.element;
  if (view.tight !== tight) {
    element.replaceChildren();
    Object.assign(view, { tight, settled: 0, last: null });
  }
  let at = view.last ? view.last.nextSibling : element.firstChild; // the first node not settled
  let settling = true;
  for (let i = view.settled; i < block.children.length; i++) {
    const child = block.children[i];
    const node = draw(child, tight);
    let last = node;
    if (node === at) at = at.nextSibling;
    else {
      removeFrom(at);
      at = null;
      if (node.nodeType === Node.DOCUMENT_FRAGMENT_NODE) last = node.lastChild;
      element.append(node);
    }
    if (settling && child.final) {
      view.settled = i + 1;
      view.last = last ?? view.last;
    } else settling = false;
  }
  removeFrom(at);
  return element;
}

function removeFrom(node) {
  while (node) {
    const next = node.nextSibling;
    node.remove();
    node = next;
  }
}

// The DOM of a whole Markdown text, as a fragment.
export function markdown(source) {
  const parser = new BlockParser();
  const lines = source.split(/\r\n|\r|\n/);
  if (lines.at(-1) === "") lines.pop(); // the final line ending ends the last line, it starts none
  for (const line of lines) parser.line(line);
  parser.finish();
  return drawContainer(parser.doc, () => document.createDocumentFragment(), false);
}

// A growing Markdown text drawn into `element` as it grows: append(text) as pieces arrive (cheap: it
// parses the lines they complete), render() when the page paints (redraws the open blocks and the last,
// unfinished line, parsed provisionally).
export class MarkdownView {
  constructor(element) {
    this.element = element;
    this.parser = new BlockParser();
    this.partial = ""; // the last line, not yet ended
    this.cr = false; // the last piece ended in "\r" (a "\n" next is the same line ending)
  }

  append(text) {
    if (this.cr && text.startsWith("\n")) text = text.slice(1);
    this.cr = text.endsWith("\r");
    text = text.replace(/\r\n?/g, "\n");
    let from = 0;
    for (let end = text.indexOf("\n"); end >= 0; from = end + 1, end = text.indexOf("\n", from)) {
      this.parser.line(this.partial + text.slice(from, end));
      this.partial = "";
    }
    this.partial += text.slice(from);
  }

  render() {
    const parser = this.parser;
    parser.provisional();
    if (this.partial) parser.line(this.partial);
    parser.finish();
    drawContainer(parser.doc, () => this.element, false);
    parser.rollback();
  }
}
