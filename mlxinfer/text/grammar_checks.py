"""What a grammar must pass before the native grammar compiler sees it.

llguidance compiles JSON Schemas and Lark grammars by recursion on the native stack: a
long `$ref` chain or a long chain of Lark rules overflows it and the process dies with
SIGSEGV (no exception, no log line). So what reaches it is bounded here first, in plain
Python that never recurses deeper than the limits it enforces: size in bytes, nesting
depth (counted through `$ref`s and rule references, as the compiler walks them), and the
number of Lark rules. Every refusal names the limit.

A grammar whose rule can never finish (`{"$ref": "#"}`, a left-recursive Lark rule with
no base case) would be accepted by the compiler and generate nothing, or loop until
max_tokens; `check_schema` / `check_lark` find such rules by the textbook fixpoint over
an and-or graph (a rule is productive when one of its alternatives needs only
productive parts) and name the first one that can never complete.
"""

from __future__ import annotations

import json
import re
from collections import deque
from typing import Any, Callable, Iterable
from urllib.parse import unquote

from ..base.errors import InvalidOptionError

MAX_BYTES = 64 * 1024  # a schema, regex or Lark grammar as sent
MAX_DEPTH = 64  # JSON nesting (through $refs), or Lark rules referring to rules (and groups)
MAX_RULES = 500  # Lark rules and terminals
MAX_TOOLS_BYTES = 256 * 1024  # every tool's parameters together


def nesting(value: Any, what: str) -> int:
    """How deep `value` (JSON-like dicts and lists) nests, found without recursion; a
    circular object (possible only from Python callers) is refused."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, path = 1, {id(value)}
    stack = [(value, iter(_containers(value)))]
    while stack:
        child = next(stack[-1][1], None)
        if child is None:
            path.discard(id(stack.pop()[0]))
        elif id(child) in path:
            raise InvalidOptionError(f"{what} contains itself (a circular object); pass plain JSON")
        else:
            path.add(id(child))
            stack.append((child, iter(_containers(child))))
            deepest = max(deepest, len(stack))
    return deepest


def check_depth(value: Any, what: str, limit: int = MAX_DEPTH) -> None:
    depth = nesting(value, what)
    if depth > limit:
        raise InvalidOptionError(f"{what} is nested {depth} deep; the limit is {limit}")


def check_size(text: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise InvalidOptionError(f"{what} takes {size} bytes; the limit is {MAX_BYTES} (64 KiB)")


def check_schema(schema: Any, what: str) -> int:
    """A JSON Schema within every limit, and with no part that can never complete; its
    depth through $refs (what the compiler's recursion walks)."""
    check_depth(schema, what)
    check_size(json.dumps(schema), what)
    refs = _Refs(schema)
    refs.check_targets(what)
    depth = deepest(schema, lambda node: 1, refs.children)
    if depth > MAX_DEPTH:
        raise InvalidOptionError(f"{what} is nested {depth} deep through its $refs; the limit is {MAX_DEPTH}")
    graph = _Graph()
    root = _built(lambda: _SchemaBuilder(graph, refs).node(schema, "#"), what)
    stuck = graph.never_completes(root)
    if stuck is not None:
        name = "the schema ('#')" if stuck == "#" else repr(stuck)
        raise InvalidOptionError(f"{what} can never complete: {name} needs another value of itself in every "
                                 "alternative (a $ref loop with no way out); give it a branch that ends")
    return depth


def check_lark(lark: str, what: str) -> None:
    """A Lark grammar within every limit, and with no rule that can never complete."""
    check_size(lark, what)
    count = len(_HEADER.findall(lark))
    if count > MAX_RULES:
        raise InvalidOptionError(f"{what} has {count} rules; the limit is {MAX_RULES}")
    grammar = _parse_lark(lark, what)
    if grammar is None:  # syntax we do not model: llguidance checks it, the worker bounds it
        return
    inner = [check_schema(schema, f"{what} %json #{i + 1}") for i, schema in enumerate(grammar.schemas)]

    def weight(node: tuple) -> int:
        return 1 if node[0] in ("rule", "group") else inner[node[1]] if node[0] == "json" else 0

    depth = deepest(("all", list(grammar.rules.values())), weight, grammar.children)
    if depth > MAX_DEPTH:
        raise InvalidOptionError(f"{what} nests {depth} deep (rules within rules, groups and %json schemas); "
                                 f"the limit is {MAX_DEPTH}")
    if "start" not in grammar.rules:
        return
    graph = _Graph()
    root = _built(lambda: _LarkBuilder(graph, grammar).rule("start"), what)
    stuck = graph.never_completes(root)
    if stuck is not None:
        raise InvalidOptionError(f"{what} can never complete: {stuck} needs itself again in every alternative "
                                 "(recursion with no base case); give it an alternative that ends")


def _built(build: Callable[[], int], what: str) -> int:
    """The and-or graph's root. Its builders recurse along one walk of the grammar: the depth
    measured above bounds it for the walk `deepest` took, and another walk of a cyclic
    grammar can go deeper; past Python's recursion limit that is a grammar too deep."""
    try:
        return build()
    except RecursionError:
        raise InvalidOptionError(f"{what} nests too deep through its references; the limit is {MAX_DEPTH}") from None


def deepest(root: Any, weight: Callable[[Any], int], children: Callable[[Any], Iterable[Any]]) -> int:
    """The heaviest path from `root` (each node adds `weight`), following `children`
    without recursion; a child already on the path closes a cycle and adds nothing, a
    node already measured is not walked again (linear time, as the compiler's own walk)."""
    memo: dict[int, int] = {}
    path = {id(root)}
    stack: list[list[Any]] = [[root, iter(children(root)), 0]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            path.discard(id(frame[0]))
            memo[id(frame[0])] = total = frame[2] + weight(frame[0])
            if stack:
                stack[-1][2] = max(stack[-1][2], total)
        elif id(child) in memo:
            frame[2] = max(frame[2], memo[id(child)])
        elif id(child) not in path:
            path.add(id(child))
            stack.append([child, iter(children(child)), 0])
    return memo[id(root)]


def _containers(value: Any) -> Iterable[Any]:
    items = value.values() if isinstance(value, dict) else value
    return [v for v in items if isinstance(v, (dict, list))]


class _Refs:
    """Local `$ref`s (`#`, `#/json/pointer`) of one schema document resolved to the nodes they name."""

    def __init__(self, root: Any):
        self.root = root

    def resolve(self, ref: Any) -> Any | None:
        if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
            return None  # remote, anchor or $id-relative: llguidance resolves or refuses it
        node = self.root
        for part in ref[2:].split("/") if len(ref) > 1 else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def check_targets(self, what: str) -> None:
        """Every JSON-pointer `$ref` names a part of the document."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            ref = node.get("$ref") if isinstance(node, dict) else None
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and self.resolve(ref) is None:
                raise InvalidOptionError(f"{what} has a $ref to {ref!r}, which is not in it; point it at a part "
                                         "of the schema, e.g. '#/$defs/name'")
            if isinstance(node, dict):  # values (const, enum, ...) are data, whatever keys they hold
                node = {k: v for k, v in node.items() if k not in ("const", "enum", "default", "examples")}
            stack.extend(_containers(node))

    def children(self, node: Any) -> list[Any]:
        """Containers under `node`, and what its `$ref` names (the compiler walks into it)."""
        found = _containers(node)
        if isinstance(node, dict):
            target = self.resolve(node.get("$ref"))
            if isinstance(target, (dict, list)):
                found.append(target)
        return found


class _Graph:
    """An and-or graph: a node completes when all (AND) or one (OR) of its `needs` do;
    `enters` are further parts a generation may walk into without needing them."""

    AND, OR = "and", "or"

    def __init__(self):
        self.kind: list[str] = []
        self.needs: list[list[int]] = []
        self.enters: list[list[int]] = []
        self.label: list[str | None] = []

    def add(self, kind: str, label: str | None = None, needs: list[int] | None = None) -> int:
        self.kind.append(kind)
        self.needs.append(needs or [])
        self.enters.append([])
        self.label.append(label)
        return len(self.kind) - 1

    def always(self) -> int:
        return self.add(self.AND)

    def productive(self) -> list[bool]:
        """Which nodes can complete: the least fixpoint, by counting down each node's
        unmet needs (linear in the edges)."""
        n = len(self.kind)
        waiting = [len(self.needs[i]) if self.kind[i] == self.AND else 1 for i in range(n)]
        users: list[list[int]] = [[] for _ in range(n)]
        for i, needs in enumerate(self.needs):
            for j in needs:
                users[j].append(i)
        done = [self.kind[i] == self.AND and not self.needs[i] for i in range(n)]
        queue = deque(i for i in range(n) if done[i])
        while queue:
            for user in users[queue.popleft()]:
                waiting[user] -= 1
                if not done[user] and waiting[user] <= 0:
                    done[user] = True
                    queue.append(user)
        return done

    def never_completes(self, root: int) -> str | None:
        """The label of a part reachable from `root` that can never complete and lies on a
        cycle of such parts (the loop to blame), or None when there is none."""
        done = self.productive()
        if all(done):
            return None
        edges = [self.needs[i] + self.enters[i] for i in range(len(self.kind))]
        seen, order = {root}, [root]
        for node in order:  # breadth-first: every part a generation can reach
            for child in edges[node]:
                if child not in seen:
                    seen.add(child)
                    order.append(child)
        state = {}  # absent: unvisited, 1: on the path, 2: finished
        for start in (i for i in order if not done[i]):
            if start in state:
                continue
            path, stack = [start], [iter(self.needs[start])]
            state[start] = 1
            while stack:
                child = next(stack[-1], None)
                if child is None:
                    state[path.pop()] = 2
                    stack.pop()
                elif done[child] or state.get(child) == 2:
                    continue
                elif state.get(child) == 1:
                    loop = path[path.index(child):]
                    return next((self.label[i] for i in loop if self.label[i]), None) or "a rule"
                else:
                    state[child] = 1
                    path.append(child)
                    stack.append(iter(self.needs[child]))
        return None


class _SchemaBuilder:
    """A JSON Schema as an and-or graph, with the semantics llguidance gives it: a value
    needs all of `allOf` and its `$ref`, one of `anyOf`/`oneOf`, and one of its `type`s;
    an object needs its required properties, an array its first `minItems` items; no
    `type` (or an `enum`/`const`) admits scalars, which always complete."""

    def __init__(self, graph: _Graph, refs: _Refs):
        self.graph, self.refs = graph, refs
        self.memo: dict[int, int] = {}

    def node(self, schema: Any, pointer: str) -> int:
        g = self.graph
        if schema is False:
            return g.add(g.OR)
        if not isinstance(schema, dict):
            return g.always()  # `true`, or not a schema (llguidance refuses it)
        if id(schema) in self.memo:
            return self.memo[id(schema)]
        me = self.memo[id(schema)] = g.add(g.AND, pointer)
        needs = g.needs[me]
        ref = schema.get("$ref")
        target = self.refs.resolve(ref)
        if target is not None:
            needs.append(self.node(target, ref))
        for i, sub in enumerate(_list(schema.get("allOf"))):
            needs.append(self.node(sub, f"{pointer}/allOf/{i}"))
        for key in ("anyOf", "oneOf"):
            options = [self.node(sub, f"{pointer}/{key}/{i}") for i, sub in enumerate(_list(schema.get(key)))]
            if options:
                needs.append(g.add(g.OR, needs=options))
        types = schema.get("type")
        if "enum" not in schema and "const" not in schema and isinstance(types, (str, list)):
            kinds = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
            needs.append(g.add(g.OR, needs=[self.typed(schema, pointer, kind) for kind in kinds]))
        return me

    def typed(self, schema: dict, pointer: str, kind: str) -> int:
        g = self.graph
        me = g.always()
        if kind == "object":
            properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = {r for r in _list(schema.get("required")) if isinstance(r, str)}
            for name, sub in properties.items():
                part = self.node(sub, f"{pointer}/properties/{_escaped(name)}")
                (g.needs if name in required else g.enters)[me].append(part)
            extra = schema.get("additionalProperties")
            if isinstance(extra, (dict, bool)) and "patternProperties" not in schema:
                part = self.node(extra, f"{pointer}/additionalProperties")
                g.enters[me].append(part)
                if required - properties.keys():
                    g.needs[me].append(part)
            for name, sub in (schema.get("patternProperties") or {}).items() if isinstance(
                    schema.get("patternProperties"), dict) else ():
                g.enters[me].append(self.node(sub, f"{pointer}/patternProperties/{name}"))
        elif kind == "array":
            prefix = _list(schema.get("prefixItems")) or _list(schema.get("items"))
            rest = schema.get("items") if isinstance(schema.get("items"), (dict, bool)) else \
                schema.get("additionalItems")
            least = schema.get("minItems", 0) if isinstance(schema.get("minItems", 0), int) else 0
            for i, sub in enumerate(prefix):
                (g.needs if i < least else g.enters)[me].append(self.node(sub, f"{pointer}/prefixItems/{i}"))
            if isinstance(rest, (dict, bool)):
                part = self.node(rest, f"{pointer}/items")
                (g.needs if least > len(prefix) else g.enters)[me].append(part)
        return me


def _escaped(key: str) -> str:
    """`key` as one JSON pointer step."""
    return key.replace("~", "~0").replace("/", "~1")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


# --- Lark, as llguidance reads it: enough of the syntax to see rules, references and %json ---

_HEADER = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_\-]*(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_TOKEN = re.compile(r"""
    (?P<space>[ \t\f\r]+) | (?P<newline>\n) | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?) | (?P<regex>/(?![/*])(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<special><[^<>\n]*>) | (?P<directive>%[A-Za-z_]+) | (?P<grammar>@[A-Za-z0-9_\-]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_\-]*) | (?P<number>\d+) | (?P<op>->|\.\.|[:|()\[\]?*+~{},.&=!^])
""", re.X)


class _LarkGrammar:
    """Rules and terminals as nested tuples: ("rule", name, alternatives), ("group",
    alternatives), ("opt", item), ("ref", name), ("json", index), ("term",)."""

    def __init__(self):
        self.rules: dict[str, tuple] = {}
        self.schemas: list[Any] = []

    def children(self, node: tuple) -> list[tuple]:
        kind = node[0]
        if kind == "all":
            return node[1]
        if kind == "ref":
            return [self.rules[node[1]]] if node[1] in self.rules else []
        if kind in ("rule", "group"):
            return [item for seq in node[-1] for item in seq]
        return [node[1]] if kind == "opt" else []


class _Unmodelled(Exception):
    """Lark syntax this reader does not model (templates, parametric rules...)."""


def _tokens(lark: str) -> list[tuple[str, str, bool]]:
    """(kind, text, first on its line), with `%json {...}`'s object as one "json" token."""
    out: list[tuple[str, str, bool]] = []
    pos, line_start = 0, True
    while pos < len(lark):
        m = _TOKEN.match(lark, pos)
        if m is None:
            raise _Unmodelled
        kind, text, pos = m.lastgroup, m.group(), m.end()
        if kind == "newline":
            line_start = True
            continue
        if kind in ("space", "comment"):
            continue
        if kind == "directive" and text in ("%json", "%regex", "%llguidance"):
            start = len(lark) - len(lark[pos:].lstrip())
            pos = _json_end(lark, start)
            kind = {"%json": "json", "%regex": "term"}.get(text, "directive")
            out.append((kind, lark[start:pos] if kind != "directive" else text, line_start))
        else:
            out.append((kind, text, line_start))
        line_start = False
    return out


def _header(tokens: list[tuple[str, str, bool]], i: int) -> tuple[str, int] | None:
    """(the name, where its body starts) when a definition opens at token `i`:
    `[?!]name[options].priority:`."""
    j = i + (tokens[i][0] == "op" and tokens[i][1] in ("?", "!"))
    if j >= len(tokens) or tokens[j][0] != "name":
        return None
    name, j = tokens[j][1], j + 1
    if j < len(tokens) and tokens[j][1] == "[":  # options: name[capture, lazy]:
        while j < len(tokens) and tokens[j][1] != "]":
            j += 1
        j += 1
    if j + 1 < len(tokens) and tokens[j][1] == "." and tokens[j + 1][0] == "number":
        j += 2
    if j >= len(tokens) or tokens[j][:2] != ("op", ":"):
        return None
    if j + 1 < len(tokens) and tokens[j + 1][1] == ":":
        raise _Unmodelled  # a parametric rule (name::)
    return name, j + 1


def _json_end(text: str, start: int) -> int:
    """The end of the JSON object that opens at `start`."""
    if text[start:start + 1] != "{":
        raise _Unmodelled
    depth, pos, in_string = 0, start, False
    while pos < len(text):
        c = text[pos]
        if in_string:
            if c == "\\":
                pos += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    raise _Unmodelled


def _parse_lark(lark: str, what: str) -> _LarkGrammar | None:
    """The grammar's definitions, or None when it uses syntax this reader does not model."""
    try:
        tokens = _tokens(lark)
        grammar = _LarkGrammar()
        bodies: dict[str, list[tuple[str, str, bool]]] = {}
        current: list | None = None
        i = 0
        while i < len(tokens):
            kind, text, first = tokens[i]
            header = _header(tokens, i) if first else None
            if header is not None:
                name, i = header
                current = bodies.setdefault(name, [])
                if current:
                    raise _Unmodelled  # a name defined twice: llguidance reports it
                continue
            if first and kind == "directive":
                current = None  # %ignore, %import ...: not part of any rule
            elif current is not None:
                current.append(tokens[i])
            i += 1
        for name, body in bodies.items():
            reader = _BodyReader(body, grammar, what)
            alternatives = reader.alternatives(0)
            if reader.pos != len(body):
                raise _Unmodelled
            grammar.rules[name] = ("rule", name, alternatives)
        return grammar
    except _Unmodelled:
        return None


class _BodyReader:
    """Recursive descent over one definition's tokens; groups deeper than MAX_DEPTH are refused."""

    def __init__(self, tokens: list[tuple[str, str, bool]], grammar: _LarkGrammar, what: str):
        self.tokens, self.grammar, self.what, self.pos = tokens, grammar, what, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def alternatives(self, depth: int) -> list[list[tuple]]:
        if depth > MAX_DEPTH:
            raise InvalidOptionError(f"{self.what} nests groups over {MAX_DEPTH} deep; the limit is {MAX_DEPTH}")
        seqs = [self.sequence(depth)]
        while self.peek() == "|":
            self.pos += 1
            seqs.append(self.sequence(depth))
        return seqs

    def sequence(self, depth: int) -> list[tuple]:
        items = []
        while self.peek() not in (None, "|", ")", "]"):
            if self.peek() == "->":  # an alias names the tree node: nothing to generate
                self.pos += 2
                continue
            items.append(self.item(depth))
        return items

    def item(self, depth: int) -> tuple:
        if self.pos >= len(self.tokens):
            raise _Unmodelled
        kind, text, _ = self.tokens[self.pos]
        self.pos += 1
        if kind == "op" and text in ("~", "&", "!", "^"):  # terminal algebra (~A, A & B): a lexeme
            self.item(depth)
            return ("term",)
        if text in ("(", "["):
            inner = ("group", self.alternatives(depth + 1))
            if self.peek() != (")" if text == "(" else "]"):
                raise _Unmodelled
            self.pos += 1
            atom = inner if text == "(" else ("opt", inner)
        elif kind == "name":
            lexeme = text.lstrip("_")[:1].isupper()
            atom = ("term",) if lexeme else ("ref", text)
            if self.peek() == "{":
                raise _Unmodelled  # a template: name{args}
        elif kind == "json":
            try:
                self.grammar.schemas.append(json.loads(text))
            except (ValueError, RecursionError):
                raise _Unmodelled from None
            atom = ("json", len(self.grammar.schemas) - 1)
        elif kind in ("string", "regex", "special", "grammar", "term"):
            atom = ("term",)
            if self.peek() == ".." and kind == "string":
                self.pos += 2
        else:
            raise _Unmodelled
        return self.repeated(atom)

    def repeated(self, atom: tuple) -> tuple:
        op = self.peek()
        if op in ("?", "*"):
            self.pos += 1
            return ("opt", atom)
        if op == "+":
            self.pos += 1
        elif op == "~" and self.pos + 1 < len(self.tokens) and self.tokens[self.pos + 1][0] == "number":
            least = int(self.tokens[self.pos + 1][1])
            self.pos += 2
            if self.peek() == ".." and self.pos + 1 < len(self.tokens):
                self.pos += 2
            return ("opt", atom) if least == 0 else atom
        elif op == "{":
            end = next((k for k in range(self.pos, len(self.tokens)) if self.tokens[k][1] == "}"), None)
            if end is None:
                raise _Unmodelled
            bounds = [t[1] for t in self.tokens[self.pos + 1 : end]]
            self.pos = end + 1
            least = int(bounds[0]) if bounds and bounds[0].isdigit() else 0
            return ("opt", atom) if least == 0 else atom
        return atom


class _LarkBuilder:
    """Lark rules as an and-or graph: a rule needs one alternative, an alternative all of
    its items; optional items need nothing (but can be entered); %json needs its schema."""

    def __init__(self, graph: _Graph, grammar: _LarkGrammar):
        self.graph, self.grammar = graph, grammar
        self.memo: dict[str, int] = {}
        self.schemas: dict[int, int] = {}

    def rule(self, name: str) -> int:
        if name in self.memo:
            return self.memo[name]
        g = self.graph
        me = self.memo[name] = g.add(g.OR, f"rule {name!r}")
        g.needs[me].extend(self.sequence(seq) for seq in self.grammar.rules[name][2])
        return me

    def sequence(self, items: list[tuple]) -> int:
        g = self.graph
        me = g.always()
        for item in items:
            if item[0] == "opt":
                g.enters[me].append(self.item(item[1]))
            elif item[0] != "term":
                g.needs[me].append(self.item(item))
        return me

    def item(self, item: tuple) -> int:
        g = self.graph
        kind = item[0]
        if kind == "ref":
            name = item[1]
            lexeme = name not in self.grammar.rules or name.lstrip("_")[:1].isupper()
            return g.always() if lexeme else self.rule(name)
        if kind == "group":
            return g.add(g.OR, needs=[self.sequence(seq) for seq in item[1]])
        if kind == "opt":
            me = g.always()
            g.enters[me].append(self.item(item[1]))
            return me
        if kind == "json":
            if item[1] not in self.schemas:
                schema = self.grammar.schemas[item[1]]
                self.schemas[item[1]] = _SchemaBuilder(g, _Refs(schema)).node(schema, f"%json #{item[1] + 1} '#'")
            return self.schemas[item[1]]
        return g.always()
