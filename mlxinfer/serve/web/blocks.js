// Markdown's block structure, CommonMark's way: text line by line into a tree of blocks (paragraphs,
// ATX and setext headings, thematic breaks, fenced and indented code, block quotes, bullet and ordered
// lists, nested, tight or loose); a leaf keeps its lines of text for the inline parse (inline.js).
// Raw HTML, link reference definitions and tables are not parsed: their lines are paragraph text.
//
// A reply is untrusted: each line is looked at once, with no backtracking regular expressions, and
// containers nest at most MAX_DEPTH deep (deeper markers are text), so time is linear in the text. A
// reply also arrives in pieces: provisional() ... rollback() parses its unfinished last line and then
// undoes every change that line made, so a growing text is parsed once, line by line.

import { unescape } from "./inline.js";

const MAX_DEPTH = 16; // block quotes and list items inside one another
const CODE_INDENT = 4;
const TAB = 9, SPACE = 32, HASH = 35, CLOSE_PAREN = 41, STAR = 42, PLUS = 43, DASH = 45, DOT = 46;
const EQUALS = 61, GREATER = 62, UNDERSCORE = 95, BACKTICK = 96, TILDE = 126;
const MAYBE_SPECIAL = /[#`~*+_=>0-9-]/; // the first characters that can start a block (a quick test)

// What a line does to a block it continues (YES, NO, or DONE: it was the block's last line, a closing
// fence), and what a block start found (NO, CONTAINER, LEAF taking the rest of the line as text, or DONE:
// the line is used up).
const YES = 0, NO = 1, DONE = 2, CONTAINER = 3, LEAF = 4;

const isSpaceOrTab = (c) => c === SPACE || c === TAB;
const isDigit = (c) => c >= 48 && c <= 57;

function blankFrom(s, i) {
  for (; i < s.length; i++) if (!isSpaceOrTab(s.charCodeAt(i))) return false;
  return true;
}

function canContain(parent, child) {
  if (parent === "list") return child === "item";
  return (parent === "document" || parent === "quote" || parent === "item") && child !== "item";
}

// A block: a container ("document", "quote", "list", "item") of `children`, or a leaf ("paragraph",
// "heading", "hr", "code") of `lines`. `start` and `end` are line numbers (tight and loose lists tell
// by the blank lines between blocks); `final` is set once it is closed for good (not provisionally).
function makeBlock(type, parent, line) {
  const depth = parent ? parent.depth + (type === "quote" || type === "item" ? 1 : 0) : 0;
  return { type, parent, depth, children: [], lines: [], open: true, final: false, start: line, end: line };
}

// The ATX heading level at `p` (the `#`s, then a space, a tab or the end), 0 if none.
function atxLevel(s, p) {
  let n = 0;
  while (n < 7 && s.charCodeAt(p + n) === HASH) n++;
  return n <= 6 && (p + n >= s.length || isSpaceOrTab(s.charCodeAt(p + n))) ? n : 0;
}

// An ATX heading's text: without its optional closing `#`s.
function atxText(s) {
  let end = s.length;
  while (end > 0 && isSpaceOrTab(s.charCodeAt(end - 1))) end--;
  let hashes = end;
  while (hashes > 0 && s.charCodeAt(hashes - 1) === HASH) hashes--;
  if (hashes < end && (hashes === 0 || isSpaceOrTab(s.charCodeAt(hashes - 1)))) end = hashes;
  return s.slice(0, end);
}

// `***`, `---` or `___` (three or more, spaces between allowed, nothing else) at `p`.
function isThematicBreak(s, p) {
  const c = s.charCodeAt(p);
  let n = 0;
  for (let i = p; i < s.length; i++) {
    const d = s.charCodeAt(i);
    if (d === c) n++;
    else if (!isSpaceOrTab(d)) return false;
  }
  return n >= 3;
}

// A setext underline at `p`: `=`s or `-`s, then only spaces.
function isSetextLine(s, p) {
  const c = s.charCodeAt(p);
  let i = p;
  while (s.charCodeAt(i) === c) i++;
  return blankFrom(s, i);
}

// The length of a closing fence for `fence` at `p` (a run as long as the opening one or longer, then
// only spaces), 0 if none.
function closingFence(s, p, fence) {
  let i = p;
  while (s.charCodeAt(i) === fence.char) i++;
  return i - p >= fence.length && blankFrom(s, i) ? i - p : 0;
}

export class BlockParser {
  constructor() {
    this.doc = makeBlock("document", null, 0);
    this.tip = this.doc; // the deepest open block
    this.lineNumber = 0;
    this.log = null; // while provisional: [object, key, old value, ...] to undo
  }

  // --- changes to existing blocks go through set/push, so a provisional line can be undone ---
  set(object, key, value) {
    if (this.log) this.log.push(object, key, object[key]);
    object[key] = value;
  }

  push(array, value) {
    this.set(array, "length", array.length);
    array.push(value);
  }

  provisional() {
    this.log = [];
    this.saved = [this.tip, this.lineNumber];
  }

  rollback() {
    const log = this.log;
    for (let i = log.length - 3; i >= 0; i -= 3) log[i][log[i + 1]] = log[i + 2];
    this.log = null;
    [this.tip, this.lineNumber] = this.saved;
  }

  // --- the position in the current line (columns count tabs to the next multiple of 4) ---
  findNextNonspace() {
    const s = this.text;
    let i = this.offset;
    let column = this.column;
    for (; i < s.length; i++) {
      const c = s.charCodeAt(i);
      if (c === SPACE) column++;
      else if (c === TAB) column += 4 - (column % 4);
      else break;
    }
    this.blank = i >= s.length;
    this.nextNonspace = i;
    this.nextNonspaceColumn = column;
    this.indent = column - this.column;
    this.indented = this.indent >= CODE_INDENT;
  }

  advanceOffset(count, columns) {
    const s = this.text;
    while (count > 0 && this.offset < s.length) {
      if (s.charCodeAt(this.offset) === TAB) {
        const toTab = 4 - (this.column % 4);
        if (columns) {
          this.partialTab = toTab > count;
          const step = Math.min(toTab, count);
          this.column += step;
          if (!this.partialTab) this.offset++;
          count -= step;
        } else {
          this.partialTab = false;
          this.column += toTab;
          this.offset++;
          count--;
        }
      } else {
        this.partialTab = false;
        this.offset++;
        this.column++;
        count--;
      }
    }
  }

  advanceNextNonspace() {
    this.offset = this.nextNonspace;
    this.column = this.nextNonspaceColumn;
    this.partialTab = false;
  }

  // One line (without its line ending): CommonMark's block step.
  line(text) {
    this.lineNumber++;
    this.text = text.includes("\0") ? text.replaceAll("\0", "\ufffd") : text;
    this.offset = this.column = 0;
    this.partialTab = false;
    this.oldTip = this.tip;
    let container = this.doc;
    for (let child = container.children.at(-1); child?.open; child = container.children.at(-1)) {
      container = child;
      this.findNextNonspace();
      const r = this.continues(container);
      if (r === DONE) return;
      if (r === NO) {
        container = container.parent;
        break;
      }
    }
    this.allClosed = container === this.oldTip;
    this.lastMatched = container;
    let leaf = container.type === "code";
    while (!leaf) {
      this.findNextNonspace();
      if (!this.indented && !MAYBE_SPECIAL.test(this.text[this.nextNonspace] ?? "")) {
        this.advanceNextNonspace();
        break;
      }
      const r = this.blockStart(container);
      if (r === DONE) return;
      if (r === NO) {
        this.advanceNextNonspace();
        break;
      }
      container = this.tip;
      leaf = r === LEAF;
    }
    if (!this.allClosed && !this.blank && this.tip.type === "paragraph") this.addLine(); // a lazy continuation
    else {
      this.closeUnmatched();
      if (container.type === "paragraph" || container.type === "code") this.addLine();
      else if (!this.blank) {
        this.addChild("paragraph");
        this.advanceNextNonspace();
        this.addLine();
      }
    }
  }

  // Whether the current line continues the open block `b`, past the markers it takes.
  continues(b) {
    const s = this.text;
    switch (b.type) {
      case "quote":
        if (this.indented || s.charCodeAt(this.nextNonspace) !== GREATER) return NO;
        this.advanceNextNonspace();
        this.advanceOffset(1, false);
        if (isSpaceOrTab(s.charCodeAt(this.offset))) this.advanceOffset(1, true);
        return YES;
      case "item":
        if (this.blank) {
          if (!b.children.length) return NO; // a blank line after an empty item ends it
          this.advanceNextNonspace();
          return YES;
        }
        if (this.indent < b.markerOffset + b.padding) return NO;
        this.advanceOffset(b.markerOffset + b.padding, true);
        return YES;
      case "heading":
      case "hr":
        return NO;
      case "code":
        if (b.fence) {
          if (this.indent <= 3 && closingFence(s, this.nextNonspace, b.fence)) {
            this.close(b, this.lineNumber);
            return DONE;
          }
          for (let i = b.fence.offset; i > 0 && isSpaceOrTab(s.charCodeAt(this.offset)); i--) this.advanceOffset(1, true);
          return YES;
        }
        if (this.indent >= CODE_INDENT) this.advanceOffset(CODE_INDENT, true);
        else if (this.blank) this.advanceNextNonspace();
        else return NO;
        return YES;
      case "paragraph":
        return this.blank ? NO : YES;
      default: // document, list
        return YES;
    }
  }

  // A new block starting at the current position, as a child of `container` (or of the first of its
  // ancestors that can hold it).
  blockStart(container) {
    const s = this.text;
    const p = this.nextNonspace;
    const c = s.charCodeAt(p);
    if (!this.indented) {
      if (c === GREATER && container.depth < MAX_DEPTH) {
        this.advanceNextNonspace();
        this.advanceOffset(1, false);
        if (isSpaceOrTab(s.charCodeAt(this.offset))) this.advanceOffset(1, true);
        this.closeUnmatched();
        this.addChild("quote");
        return CONTAINER;
      }
      const level = c === HASH ? atxLevel(s, p) : 0;
      if (level) {
        this.closeUnmatched();
        const heading = this.addChild("heading");
        heading.level = level;
        heading.lines.push(atxText(s.slice(p + level)));
        return DONE;
      }
      if (c === BACKTICK || c === TILDE) {
        let n = 0;
        while (s.charCodeAt(p + n) === c) n++;
        if (n >= 3 && (c === TILDE || s.indexOf("`", p + n) < 0)) {
          this.closeUnmatched();
          const code = this.addChild("code");
          code.fence = { char: c, length: n, offset: this.indent };
          code.lang = unescape(s.slice(p + n).trim().split(/\s/, 1)[0]);
          return DONE;
        }
      }
      if ((c === EQUALS || c === DASH) && container.type === "paragraph" && isSetextLine(s, p)) {
        this.closeUnmatched();
        this.set(container, "type", "heading");
        this.set(container, "level", c === EQUALS ? 1 : 2);
        return DONE;
      }
      if ((c === STAR || c === DASH || c === UNDERSCORE) && isThematicBreak(s, p)) {
        this.closeUnmatched();
        this.addChild("hr");
        return DONE;
      }
    }
    const marker = container.depth < MAX_DEPTH ? this.listMarker(container) : null;
    if (marker) {
      this.closeUnmatched();
      const list = this.tip;
      if (list.type !== "list" || list.ordered !== marker.ordered || list.bullet !== marker.bullet) {
        Object.assign(this.addChild("list"), { ordered: marker.ordered, bullet: marker.bullet, start: marker.start });
      }
      Object.assign(this.addChild("item"), { markerOffset: marker.markerOffset, padding: marker.padding });
      return CONTAINER;
    }
    if (this.indented && this.tip.type !== "paragraph" && !this.blank) {
      this.advanceOffset(CODE_INDENT, true);
      this.closeUnmatched();
      this.addChild("code");
      return LEAF;
    }
    return NO;
  }

  // A list marker at the current position (`-`, `+`, `*`, or 1 to 9 digits and `.` or `)`, then a
  // space or the end): its kind, and the indent its item's content takes; the offset moves past it.
  listMarker(container) {
    if (this.indent >= CODE_INDENT) return null;
    const s = this.text;
    const p = this.nextNonspace;
    const c = s.charCodeAt(p);
    const interrupts = container.type === "paragraph";
    let marker;
    let width;
    if (c === DASH || c === PLUS || c === STAR) {
      marker = { ordered: false, bullet: s[p], start: 1 };
      width = 1;
    } else {
      let n = 0;
      while (n < 10 && isDigit(s.charCodeAt(p + n))) n++;
      const d = s.charCodeAt(p + n);
      if (n < 1 || n > 9 || (d !== DOT && d !== CLOSE_PAREN)) return null;
      const start = Number(s.slice(p, p + n));
      if (interrupts && start !== 1) return null; // only a list starting at 1 interrupts a paragraph
      marker = { ordered: true, bullet: s[p + n], start };
      width = n + 1;
    }
    if (p + width < s.length && !isSpaceOrTab(s.charCodeAt(p + width))) return null;
    if (interrupts && blankFrom(s, p + width)) return null; // nor does an empty item
    marker.markerOffset = this.indent;
    this.advanceNextNonspace();
    this.advanceOffset(width, true);
    const column = this.column;
    const offset = this.offset;
    do this.advanceOffset(1, true);
    while (this.column - column < 5 && isSpaceOrTab(s.charCodeAt(this.offset)));
    const spaces = this.column - column;
    if (spaces >= 5 || spaces < 1 || this.offset >= s.length) {
      // content indented 5 or more is code inside the item, one column after the marker
      marker.padding = width + 1;
      this.column = column;
      this.offset = offset;
      if (isSpaceOrTab(s.charCodeAt(this.offset))) this.advanceOffset(1, true);
    } else marker.padding = width + spaces;
    return marker;
  }

  // The rest of the line, as text of the open leaf.
  addLine() {
    const tip = this.tip;
    let text = this.text.slice(this.offset);
    if (this.partialTab) text = " ".repeat(4 - (this.column % 4)) + text.slice(1);
    this.push(tip.lines, text);
    if (tip.type === "code" && !tip.fence) this.set(tip, "blankTail", this.blank ? (tip.blankTail ?? 0) + 1 : 0);
  }

  // A new block under the tip (closing the open blocks that cannot hold it); a blank line between it
  // and the block before it in a list item, or between two items, makes that list loose.
  addChild(type) {
    while (!canContain(this.tip.type, type)) this.close(this.tip, this.lineNumber - 1);
    const parent = this.tip;
    const previous = parent.children.at(-1);
    if (previous && previous.end < this.lineNumber - 1 && (parent.type === "list" || parent.type === "item")) {
      this.set(parent.type === "list" ? parent : parent.parent, "loose", true); // a blank line between two of its blocks
    }
    const child = makeBlock(type, parent, this.lineNumber);
    this.push(parent.children, child);
    this.tip = child;
    return child;
  }

  // Closes the open blocks the current line did not continue (done once a new block is sure to start).
  closeUnmatched() {
    if (this.allClosed) return;
    while (this.oldTip !== this.lastMatched) {
      const parent = this.oldTip.parent;
      this.close(this.oldTip, this.lineNumber - 1);
      this.oldTip = parent;
    }
    this.allClosed = true;
  }

  // Closes `block`, its last line `line` (a list's and an item's: their last child's; indented code
  // drops its trailing blank lines); it is final (its DOM can be kept) unless closed provisionally.
  close(block, line) {
    this.set(block, "open", false);
    let end = line;
    if (block.type === "item" || block.type === "list") end = block.children.at(-1)?.end ?? block.start;
    else if (block.type === "code" && !block.fence && block.blankTail) {
      this.set(block.lines, "length", block.lines.length - block.blankTail);
      end = block.start + block.lines.length - 1;
    }
    this.set(block, "end", end);
    if (!this.log) block.final = true;
    this.tip = block.parent;
  }

  // The end of the text: every block closes.
  finish() {
    while (this.tip) this.close(this.tip, this.lineNumber);
  }
}
