// Inline Markdown to DOM nodes: CommonMark's rules for backslash escapes, code spans, emphasis
// (`*`, `_`), inline links and line breaks. A reply is untrusted text, so this is one pass with no
// backtracking: delimiters wait on stacks (CommonMark's algorithm, with its bounds on how far back a
// closer looks), backtick runs and link destinations are found through tables built once per text,
// and the tree is spliced in place; time grows linearly with the text whatever it holds. Every piece
// of text becomes a text node, never HTML; a link keeps only an http(s) or mailto address (any other
// stays text). Raw HTML, entities, autolinks, images and reference links are not parsed: their
// characters show as written.

import { el } from "./dom.js";

const MAX_DEPTH = 16; // emphasis and links nested deeper keep their text but not their element (a shallow DOM)
const PUNCTUATION = /[\p{P}\p{S}]/u;
const WHITESPACE = /[\p{Zs}\t\n\f\r]/u;
const ESCAPABLE = /[!-/:-@[-`{-~]/; // ASCII punctuation: what a backslash escapes
const ESCAPES = /\\([!-/:-@[-`{-~])/g;
const SAFE_LINK = /^(https?:|mailto:)/i;

const TAB = 9, NEWLINE = 10, SPACE = 32, STAR = 42, OPEN_PAREN = 40, CLOSE_PAREN = 41, LESS = 60;
const OPEN_BRACKET = 91, BACKSLASH = 92, CLOSE_BRACKET = 93, UNDERSCORE = 95, BACKTICK = 96;

// A node of the inline tree: "text", "run" (a delimiter run: `count` times `char`), "code", "br",
// or a container ("em", "strong", "link") of children, as a doubly linked list (splicing is O(1)).
function node(kind, text = "") {
  return { kind, text, href: "", char: "", count: 0, first: null, last: null, prev: null, next: null };
}

function appendChild(parent, child) {
  child.prev = parent.last;
  child.next = null;
  if (parent.last) parent.last.next = child;
  else parent.first = child;
  parent.last = child;
}

function unlink(parent, child) {
  if (child.prev) child.prev.next = child.next;
  else parent.first = child.next;
  if (child.next) child.next.prev = child.prev;
  else parent.last = child.prev;
  child.prev = child.next = null;
}

// The character before `i` and the one at `i`, whole code points; a line's edges count as a newline
// (CommonMark's flanking rules look at both).
function charBefore(s, i) {
  if (i === 0) return "\n";
  const low = s.charCodeAt(i - 1);
  return low >= 0xdc00 && low <= 0xdfff && i > 1 ? s.slice(i - 2, i) : s[i - 1];
}

function charAt(s, i) {
  return i < s.length ? String.fromCodePoint(s.codePointAt(i)) : "\n";
}

class Parser {
  constructor(src) {
    this.src = src;
    this.pos = 0;
    this.start = 0; // plain text runs from `start` to `pos`, not yet a node
    this.root = node("root");
    this.delimiters = null; // top of the stack of `*` / `_` runs that may open or close
    this.brackets = null; // top of the stack of `[`
    this.opened = 0; // `[` seen so far; those numbered up to `inactive` may no longer start a link (no links in links)
    this.inactive = 0;
    this.ticks = null; // backtick runs by length, made on the first backtick
    this.links = null; // link destination tables, made on the first `](`
  }

  parse() {
    const s = this.src;
    while (this.pos < s.length) {
      const c = s.charCodeAt(this.pos);
      if (c === NEWLINE) this.newline();
      else if (c === BACKSLASH) this.backslash();
      else if (c === BACKTICK) this.backticks();
      else if (c === STAR || c === UNDERSCORE) this.delimiterRun(c);
      else if (c === OPEN_BRACKET) this.openBracket();
      else if (c === CLOSE_BRACKET) this.closeBracket();
      else this.pos++;
    }
    this.text(this.pos);
    this.processEmphasis(null, this.root);
    return this.root;
  }

  // The pending plain text up to `end` becomes a node.
  text(end) {
    if (end > this.start) appendChild(this.root, node("text", this.src.slice(this.start, end)));
  }

  add(child, next) {
    appendChild(this.root, child);
    this.pos = this.start = next;
  }

  // A line ending: a hard break after two spaces or more, else a soft one (a newline in the text);
  // the spaces around it go.
  newline() {
    let end = this.pos;
    while (end > this.start && this.src.charCodeAt(end - 1) === SPACE) end--;
    this.text(end);
    this.add(this.pos - end >= 2 ? node("br") : node("text", "\n"), this.skipSpaces(this.pos + 1));
  }

  skipSpaces(i) {
    while (this.src.charCodeAt(i) === SPACE || this.src.charCodeAt(i) === TAB) i++;
    return i;
  }

  backslash() {
    const next = this.src[this.pos + 1];
    if (next === "\n") {
      this.text(this.pos);
      this.add(node("br"), this.skipSpaces(this.pos + 2));
    } else if (next !== undefined && ESCAPABLE.test(next)) {
      this.text(this.pos);
      this.add(node("text", next), this.pos + 2);
    } else this.pos++;
  }

  // A code span runs to the next backtick run of the same length; with none, the backticks are text.
  backticks() {
    const s = this.src;
    const from = this.pos;
    let end = from;
    while (s.charCodeAt(end) === BACKTICK) end++;
    const close = this.closingTicks(end - from, end);
    if (close < 0) {
      this.pos = end;
      return;
    }
    let code = s.slice(end, close).replaceAll("\n", " ");
    if (code.length > 2 && code[0] === " " && code[code.length - 1] === " " && code.trim()) code = code.slice(1, -1);
    this.text(from);
    this.add(node("code", code), close + (end - from));
  }

  // Where the first backtick run of `length` at or after `from` starts (-1: none). Runs are listed
  // once per text and each length's cursor only moves forward, as openers come left to right.
  closingTicks(length, from) {
    if (!this.ticks) {
      this.ticks = new Map();
      const s = this.src;
      for (let i = 0; i < s.length; i++) {
        if (s.charCodeAt(i) !== BACKTICK) continue;
        let j = i;
        while (s.charCodeAt(j) === BACKTICK) j++;
        if (!this.ticks.has(j - i)) this.ticks.set(j - i, { starts: [], next: 0 });
        this.ticks.get(j - i).starts.push(i);
        i = j;
      }
    }
    const runs = this.ticks.get(length);
    if (!runs) return -1;
    while (runs.next < runs.starts.length && runs.starts[runs.next] < from) runs.next++;
    return runs.next < runs.starts.length ? runs.starts[runs.next] : -1;
  }

  // A run of `*` or `_`: text, and on the delimiter stack when CommonMark's flanking rules let it
  // open or close emphasis.
  delimiterRun(c) {
    const s = this.src;
    const from = this.pos;
    let end = from;
    while (s.charCodeAt(end) === c) end++;
    const before = charBefore(s, from);
    const after = charAt(s, end);
    const afterSpace = WHITESPACE.test(after);
    const afterPunctuation = PUNCTUATION.test(after);
    const beforeSpace = WHITESPACE.test(before);
    const beforePunctuation = PUNCTUATION.test(before);
    const left = !afterSpace && (!afterPunctuation || beforeSpace || beforePunctuation);
    const right = !beforeSpace && (!beforePunctuation || afterSpace || afterPunctuation);
    const canOpen = c === UNDERSCORE ? left && (!right || beforePunctuation) : left;
    const canClose = c === UNDERSCORE ? right && (!left || afterPunctuation) : right;
    this.text(from);
    const run = node("run");
    run.char = s[from];
    run.count = end - from;
    this.add(run, end);
    if (!canOpen && !canClose) return;
    const delimiter = { node: run, original: run.count, canOpen, canClose, prev: this.delimiters, next: null };
    if (this.delimiters) this.delimiters.next = delimiter;
    this.delimiters = delimiter;
  }

  removeDelimiter(d) {
    if (d.prev) d.prev.next = d.next;
    if (d.next) d.next.prev = d.prev;
    else this.delimiters = d.prev;
  }

  openBracket() {
    this.text(this.pos);
    const opener = node("text", "[");
    this.add(opener, this.pos + 1);
    this.brackets = { node: opener, delimiters: this.delimiters, number: ++this.opened, prev: this.brackets };
  }

  // `]` closes the last `[` into a link when an inline destination follows; else it is text.
  closeBracket() {
    const opener = this.brackets;
    if (!opener) {
      this.pos++;
      return;
    }
    this.brackets = opener.prev; // used either way
    const link = opener.number > this.inactive ? this.destination(this.pos + 1) : null;
    if (!link) {
      this.pos++;
      return;
    }
    this.text(this.pos);
    const root = this.root;
    const a = node("link");
    a.href = link.href;
    if (opener.node.next) {
      a.first = opener.node.next;
      a.last = root.last;
      a.first.prev = null;
      root.last = opener.node;
      opener.node.next = null;
    }
    unlink(root, opener.node);
    this.add(a, link.end);
    this.processEmphasis(opener.delimiters, a);
    this.inactive = this.opened;
  }

  // The `(destination)` at `at`: {href, end} when it is there and safe, else null. Destinations with
  // <angle brackets> or a title are not parsed (the text shows as written).
  destination(at) {
    const s = this.src;
    if (s.charCodeAt(at) !== OPEN_PAREN) return null;
    const from = this.skipBlank(at + 1);
    if (s.charCodeAt(from) === LESS) return null;
    const { depth, stop, close } = this.linkTables();
    let end;
    let to = close[from] - 1; // the `)` that balances the parentheses from here, if before a space
    if (close[from] >= 0 && to < stop[from]) end = close[from];
    else {
      to = stop[from];
      if (depth[to] !== depth[from]) return null; // unbalanced parentheses
      const after = this.skipBlank(to);
      if (s.charCodeAt(after) !== CLOSE_PAREN) return null;
      end = after + 1;
    }
    const href = unescape(s.slice(from, to));
    return SAFE_LINK.test(href) ? { href, end } : null;
  }

  skipBlank(i) {
    for (let c = this.src.charCodeAt(i); c === SPACE || c === TAB || c === NEWLINE; c = this.src.charCodeAt(++i));
    return i;
  }

  // Per position i, made once per text in O(n): depth[i], the unescaped parentheses open before i;
  // stop[i], the first space or control character at or after i (where a destination ends);
  // close[i], the first k > i with depth[k] < depth[i] (just past the `)` that closes a destination
  // starting at i; -1: none), by a monotonic stack.
  linkTables() {
    if (this.links) return this.links;
    const s = this.src;
    const n = s.length;
    const depth = new Int32Array(n + 1);
    const stop = new Int32Array(n + 1);
    const close = new Int32Array(n + 1);
    for (let i = 0, d = 0; i < n; i++) {
      depth[i] = d;
      const c = s.charCodeAt(i);
      if (c === BACKSLASH && i + 1 < n && ESCAPABLE.test(s[i + 1])) depth[++i] = d;
      else if (c === OPEN_PAREN) d++;
      else if (c === CLOSE_PAREN) d--;
      depth[i + 1] = d;
    }
    stop[n] = n;
    for (let i = n - 1; i >= 0; i--) {
      const c = s.charCodeAt(i);
      stop[i] = c <= SPACE || c === 127 ? i : stop[i + 1];
    }
    const rising = [];
    for (let i = n; i >= 0; i--) {
      while (rising.length && depth[rising[rising.length - 1]] >= depth[i]) rising.pop();
      close[i] = rising.length ? rising[rising.length - 1] : -1;
      rising.push(i);
    }
    this.links = { depth, stop, close };
    return this.links;
  }

  // CommonMark's "process emphasis" over the delimiters above `bottom`, whose runs are children of
  // `parent`: each closer looks back for an opener, no further than where an earlier closer of its kind
  // found none (openersBottom), which keeps it linear.
  processEmphasis(bottom, parent) {
    let closer = this.delimiters;
    if (closer === bottom) return;
    while (closer.prev !== bottom) closer = closer.prev;
    const openersBottom = new Array(12).fill(bottom);
    while (closer) {
      if (!closer.canClose) {
        closer = closer.next;
        continue;
      }
      const kind = (closer.node.char === "*" ? 0 : 6) + (closer.canOpen ? 3 : 0) + (closer.original % 3);
      let opener = closer.prev;
      while (opener && opener !== bottom && opener !== openersBottom[kind]) {
        const odd = (closer.canOpen || opener.canClose) && closer.original % 3 !== 0 &&
          (opener.original + closer.original) % 3 === 0;
        if (opener.node.char === closer.node.char && opener.canOpen && !odd) break;
        opener = opener.prev;
      }
      if (!opener || opener === bottom || opener === openersBottom[kind]) {
        openersBottom[kind] = closer.prev;
        const next = closer.next;
        if (!closer.canOpen) this.removeDelimiter(closer);
        closer = next;
        continue;
      }
      const use = closer.node.count >= 2 && opener.node.count >= 2 ? 2 : 1;
      opener.node.count -= use;
      closer.node.count -= use;
      const wrap = node(use === 2 ? "strong" : "em");
      const o = opener.node;
      const c = closer.node;
      if (o.next !== c) {
        wrap.first = o.next;
        wrap.last = c.prev;
        wrap.first.prev = null;
        wrap.last.next = null;
      }
      o.next = wrap;
      wrap.prev = o;
      wrap.next = c;
      c.prev = wrap;
      opener.next = closer; // the delimiters in between are used up (their runs stay text)
      closer.prev = opener;
      if (!o.count) {
        unlink(parent, o);
        this.removeDelimiter(opener);
      }
      if (!c.count) {
        unlink(parent, c);
        const next = closer.next;
        this.removeDelimiter(closer);
        closer = next;
      }
    }
    while (this.delimiters !== bottom) this.removeDelimiter(this.delimiters);
  }
}

function element(n) {
  if (n.kind === "link") return el("a", { href: n.href, target: "_blank", rel: "noopener noreferrer" });
  return el(n.kind);
}

// The tree as DOM nodes appended to `into`, walked without recursion (emphasis can nest as deep as
// the text is long); adjacent text joins into one text node.
function draw(root, into) {
  const stack = []; // per open container: [the element to return to, the node after the container]
  let parent = into;
  let item = root.first;
  let text = "";
  for (;;) {
    if (!item) {
      if (!stack.length) break;
      const [outer, after] = stack.pop();
      if (outer !== parent && text) {
        parent.append(text);
        text = "";
      }
      parent = outer;
      item = after;
      continue;
    }
    if (item.kind === "text") text += item.text;
    else if (item.kind === "run") text += item.char.repeat(item.count);
    else {
      if (text) parent.append(text);
      text = "";
      if (item.kind === "code") parent.append(el("code", { textContent: item.text }));
      else if (item.kind === "br") parent.append(el("br"));
      else {
        stack.push([parent, item.next]);
        if (stack.length <= MAX_DEPTH) parent = parent.appendChild(element(item));
        item = item.first;
        continue;
      }
    }
    item = item.next;
  }
  if (text) parent.append(text);
}

// `text` with its backslash escapes resolved (where no other inline rule applies: a link's address, a
// code fence's language).
export function unescape(text) {
  return text.replace(ESCAPES, "$1");
}

// The inline content of `text` (a paragraph's or a heading's) as a fragment of DOM nodes.
export function inline(text) {
  const out = document.createDocumentFragment();
  draw(new Parser(text).parse(), out);
  return out;
}
