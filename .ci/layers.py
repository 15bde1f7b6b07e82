#!/usr/bin/env python3
"""Checks the module layering of src/: no import cycle between files, and the
layer rules of the README's Architecture section.

Every file of src/ is a node. An edge goes from a file to the file that
*defines* each crate item it names (`use crate::…`, `use super::…`, inline
`crate::a::B` paths), following `use` re-exports to the definition, so a
`mod.rs` that only declares and re-exports its children adds no cycle. A
cycle is a set of files that reach each other. A `pub use` (re-export)
adds no edge of its own; its target is what the names resolve to. Prints the cycles and the
rule violations, and exits 1 when there is any.

Usage: python3 .ci/layers.py [--graph]   (from the repository root)
"""
import os
import re
import sys

SRC = "src"

# Layer rules: a file under the first prefix may not name an item defined
# under any of the second prefixes. Prefixes are module paths.
RULES = [
    # The admission core is pure: it imports nothing from the crate.
    ("admission", ["*"]),
    # Plain data the errors carry: leaves.
    ("status", ["pool", "lock", "lease", "census", "pooler", "http", "metrics", "error", "api", "key", "lost"]),
    ("key", ["pool", "lock", "lease", "census", "pooler", "http", "metrics", "error", "api", "status", "lost"]),
    ("lost", ["pool", "lock", "lease", "census", "pooler", "http", "metrics", "error", "api", "status", "key"]),
    # error is a leaf: it names only the data above and the admission core.
    ("error", ["pool", "lock", "lease", "census", "pooler", "http", "metrics", "api"]),
    # metrics names are a leaf too.
    ("metrics", ["pool", "lock", "lease", "census", "pooler", "http"]),
    # The pool core knows nothing of locks, leases, the census or poolers.
    ("pool", ["lock", "lease", "census", "pooler", "http", "api"]),
    # Locks, leases, the census and pooler detection build on the pool, not on
    # each other's internals (leases may use transaction locks).
    ("census", ["lease", "http"]),
    ("pooler", ["lease", "census", "http"]),
    ("lock", ["lease", "census", "http"]),
    ("lease", ["census", "http", "api"]),
    ("census", ["api"]),
    ("pooler", ["api"]),
    ("lock", ["api"]),
]

ITEM_RE = re.compile(
    r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:async\s+)?(?:const\s+)?"
    r"(struct|enum|trait|type|const|static|fn|union|mod)\s+([A-Za-z_][A-Za-z0-9_]*)",
    re.M,
)
MACRO_RE = re.compile(r"^\s*macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)", re.M)
USE_RE = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
INLINE_RE = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def strip_comments_and_strings(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def strip_tests(text):
    # `#[cfg(test)] mod tests { … }` and `#[cfg(test)] mod tests;` are not layering.
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*(;|\{)", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        if m.group(1) == ";":
            i = m.end()
            continue
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def module_of(path):
    rel = os.path.relpath(path, SRC)[:-3].split(os.sep)
    if rel == ["lib"]:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def expand_use(tree):
    """`a::{b, c::{d, e as f}}` -> [(path, alias)]"""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, t):
        depth, start, parts = 0, 0, []
        # split top-level commas
        for k, ch in enumerate(t):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(t[start:k])
                start = k + 1
        parts.append(t[start:])
        for p in parts:
            if not p:
                continue
            if "{" in p:
                head, rest = p.split("{", 1)
                walk(prefix + [s for s in head.split("::") if s], rest[:-1])
            else:
                alias = None
                if "as" in p and re.search(r"[A-Za-z0-9_]as[A-Za-z_]", p) is None and "::" in p or p.count("as") and False:
                    pass
                m = re.match(r"(.+?)as([A-Za-z_][A-Za-z0-9_]*)$", p)
                if m and not m.group(1).endswith("::") and m.group(1).split("::")[-1] != "":
                    # ambiguous with names containing "as"; accept only when the
                    # original text had " as " (checked by the caller's raw text)
                    pass
                segs = [s for s in p.split("::") if s]
                out.append((prefix + segs, alias))

    walk([], tree)
    return out


def parse_use(raw):
    """Returns [(segments, alias)] with `x as y` handled on the raw text."""
    # Replace ` as name` with a marker the splitter keeps.
    marked = re.sub(r"\s+as\s+([A-Za-z_][A-Za-z0-9_]*)", r"@\1", raw)
    res = []
    for segs, _ in expand_use(marked):
        alias = None
        if segs and "@" in segs[-1]:
            last, alias = segs[-1].split("@", 1)
            segs = segs[:-1] + [last]
        res.append((segs, alias))
    return res


def resolve_rel(mod, segs):
    """Make a path crate-absolute; None when it names another crate."""
    segs = list(segs)
    if not segs:
        return None
    if segs[0] == "crate":
        return tuple(segs[1:])
    cur = list(mod)
    if segs[0] in ("self", "super"):
        while segs and segs[0] in ("self", "super"):
            if segs[0] == "super":
                if not cur:
                    return None
                cur.pop()
            segs.pop(0)
        return tuple(cur + segs)
    return None  # external crate or a local name: resolved by the caller


def main():
    files = {}
    for root, _, names in os.walk(SRC):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                files[module_of(p)] = p
    defs, aliases, globs, texts = {}, {}, {}, {}
    for mod, path in files.items():
        text = strip_tests(strip_comments_and_strings(open(path).read()))
        texts[mod] = text
        # top-level items only: lines without leading indentation
        top = "\n".join(l for l in text.splitlines() if not l.startswith((" ", "\t")))
        d = set(m.group(2) for m in ITEM_RE.finditer(top)) | set(MACRO_RE.findall(top))
        defs[mod] = d
        al, gl = {}, []
        for m in USE_RE.finditer(text):
            for segs, alias in parse_use(m.group(2)):
                if not segs:
                    continue
                if segs[-1] == "*":
                    gl.append(segs[:-1])
                    continue
                if segs[-1] == "self":
                    segs = segs[:-1]
                name = alias or segs[-1]
                al[name] = segs
        aliases[mod], globs[mod] = al, gl

    def absolute(mod, segs, depth=0):
        if depth > 20:
            return None
        r = resolve_rel(mod, segs)
        if r is not None:
            return r
        # `use foo::Bar` where foo is a child module or an alias in scope
        first = segs[0]
        if mod + (first,) in files:
            return mod + tuple(segs)
        if first in aliases.get(mod, {}) and aliases[mod][first] != list(segs[:1]):
            base = absolute(mod, aliases[mod][first], depth + 1)
            return None if base is None else base + tuple(segs[1:])
        return None

    def definer(path, seen=None):
        """The module (file) that defines the item `path` names."""
        seen = seen or set()
        if path in seen:
            return None
        seen.add(path)
        # longest module prefix
        for k in range(len(path), -1, -1):
            m = tuple(path[:k])
            if m in files:
                break
        else:
            return None
        rest = path[k:]
        if not rest:
            return m
        name = rest[0]
        if name in defs[m]:
            return m
        if name in aliases[m]:
            target = absolute(m, aliases[m][name])
            if target is None:
                return None  # an external crate's item
            return definer(target + tuple(rest[1:]), seen)
        for g in globs[m]:
            base = absolute(m, g)
            if base is not None:
                r = definer(base + tuple(rest), seen)
                if r is not None:
                    return r
        return m

    edges = {m: set() for m in files}
    for mod, text in texts.items():
        paths = []
        for m in USE_RE.finditer(text):
            if m.group(1):
                # A re-export is a facade, not a dependency of this file's
                # code: names reached through it resolve to their definition.
                continue
            for segs, _ in parse_use(m.group(2)):
                if segs and segs[-1] in ("*", "self"):
                    segs = segs[:-1]
                a = absolute(mod, segs) if segs else None
                if a is not None:
                    paths.append(a)
        for m in INLINE_RE.finditer(text):
            a = resolve_rel(mod, m.group(1).split("::"))
            if a is not None:
                paths.append(a)
        for p in paths:
            d = definer(p)
            if d is not None and d != mod:
                edges[mod].add(d)
        # declaring a child module is not a dependency; re-exporting from it is
        # (captured above through `pub use`).

    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)

    def fname(m):
        return files[m]

    failed = False
    cycles = [c for c in sccs if len(c) > 1]
    for c in cycles:
        failed = True
        names = sorted(fname(m) for m in c)
        print(f"import cycle between {len(c)} files: " + ", ".join(names))
        for a in sorted(c):
            for b in sorted(edges[a]):
                if b in c:
                    print(f"    {fname(a)} -> {fname(b)}")

    def under(m, prefix):
        return prefix == "*" or m[: len(prefix.split("::"))] == tuple(prefix.split("::"))

    for src_prefix, banned in RULES:
        for m in files:
            if not under(m, src_prefix):
                continue
            for d in edges[m]:
                if under(d, src_prefix):
                    continue
                if any(under(d, b) for b in banned):
                    failed = True
                    print(f"layer rule: {fname(m)} ({src_prefix}) imports {fname(d)}")

    if "--graph" in sys.argv:
        for m in sorted(edges):
            print(fname(m), "->", ", ".join(sorted(fname(d) for d in edges[m])))
    if not failed:
        print(f"layers: {len(files)} files, no import cycle, layer rules hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
