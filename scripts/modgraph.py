#!/usr/bin/env python3
"""The module graph of a Rust crate, and its import cycles (issue 24: "no import circles").

Usage: scripts/modgraph.py CRATE_SRC_DIR... [--dot] [--verbose]

Reads every `.rs` file under each `src/` directory (a file `a/b.rs` or `a/b/mod.rs` is the
module `a::b`; `lib.rs`/`main.rs` the crate root) and draws an edge A -> B for each path in
A's code that names module B: `crate::…`, `super::…`, `self::…` and paths through A's own
child modules (`mod x;` then `x::…`), in `use` trees (braces expanded) and written inline.
A module's use of its own children counts (so a cycle through a child is seen); a child's
use of its ancestors does not (a child uses its parent's items by design). Comments (doc
links included) and a `#[cfg(test)] mod tests` block at a file's end do not count. Prints
one summary line per crate (`N modules, E edges, C cycles`) and each cycle (a strongly
connected component of more than one module) with its edges; `--dot` prints the graph in
Graphviz's dot language, `--verbose` every module's edges.
Exit status: 0 without cycles, 1 with any, 2 on bad usage. A text reader, not a compiler:
macro-generated paths are not seen.
"""
import os
import re
import sys


def read_modules(src):
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                parts = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split("/")
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                with open(os.path.join(dirpath, f)) as fh:
                    mods["::".join(parts)] = fh.read()
    return mods


def expand_use(prefix, tree):
    """`a::{b, c::{d as e}}` -> ['a::b', 'a::c::d']."""
    tree = tree.strip()
    if not tree:
        return []
    if tree.startswith("{"):
        parts, depth, cur = [], 0, ""
        for ch in tree[1:-1]:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += (ch == "{") - (ch == "}")
            cur += ch
        parts.append(cur)
        return [p for part in parts for p in expand_use(prefix, part)]
    m = re.match(r"([\w:]+?)(::(\{.*\}))?\s*(as \w+)?$", tree, re.S)
    if not m:
        return []
    head = m.group(1).rstrip(":")
    full = f"{prefix}::{head}" if prefix else head
    return expand_use(full, m.group(3)) if m.group(3) else [full]


def edges_of(mods):
    names = set(mods)

    def owner(path):  # the longest module prefix of an item path
        parts = path.split("::")
        for i in range(len(parts), 0, -1):
            if "::".join(parts[:i]) in names:
                return "::".join(parts[:i])
        return None

    edges = {m: set() for m in names}
    for m, src in mods.items():
        src = re.sub(r"(?m)(^|\s)//.*$", r"\1", src)  # comments, not `http://` in strings
        src = re.sub(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", "", src, flags=re.S)
        paths = []
        children = set(re.findall(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?mod\s+(\w+)\s*;", src, re.M))
        heads = "crate|super|self" + "".join("|" + c for c in sorted(children))
        for u in re.finditer(r"\buse\s+((?:%s)\b[^;]*);" % heads, src):
            paths += expand_use("", re.sub(r"\s+", " ", u.group(1)))
        paths += [a + b for a, b in re.findall(r"(?<![\w:])(%s)((?:::\w+)+)" % heads, src)]
        for p in paths:
            kind, _, rest = p.partition("::")
            if not rest:
                continue
            if kind not in ("crate", "super", "self"):  # a child module's path
                kind, rest = "self", p
            if kind == "crate":
                base = []
            elif kind == "self":
                base = m.split("::") if m else []
            else:
                base = m.split("::")[:-1] if m else []
            while rest.startswith("super::"):
                base, rest = base[:-1], rest[len("super::"):]
            t = owner("::".join(base + [rest]))
            if t is None or t == m or m.startswith(t + "::"):
                continue
            edges[m].add(t)
    return edges


def cycles(edges):
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(100000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(argv):
    dirs = [a for a in argv if not a.startswith("--")]
    if not dirs or any(not os.path.isdir(d) for d in dirs):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    found = 0
    for src in dirs:
        edges = edges_of(read_modules(src))
        cyc = cycles(edges)
        found += len(cyc)
        n_edges = sum(len(e) for e in edges.values())
        print(f"{src}: {len(edges)} modules, {n_edges} edges, {len(cyc)} cycles")
        for comp in cyc:
            print("  cycle: " + ", ".join(comp))
            for a in comp:
                print(f"    {a or '(root)'} -> {', '.join(sorted(e for e in edges[a] if e in comp))}")
        if "--dot" in argv:
            print("digraph modules {")
            for a in sorted(edges):
                for b in sorted(edges[a]):
                    print(f'  "{a or "(root)"}" -> "{b}";')
            print("}")
        if "--verbose" in argv:
            for a in sorted(edges):
                print(f"  {a or '(root)'} -> {', '.join(sorted(edges[a]))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
