#!/usr/bin/env python3
"""Module graph of one Rust crate: which module uses which, and the circles among them.

Usage: scripts/modgraph.py [SRC_DIR] [--edges]   (default crates/sandlot-node/src)

A module is a file (`a.rs` or `a/mod.rs` -> `a`, `a/b.rs` -> `a::b`, `lib.rs` -> `crate`).
Module A uses module B when A's text (comments left out) names a path into B: `crate::b::..`,
`super::..` (resolved against A's place) or `c::..` for a child module `c` of A; a path is
charged to the longest module it names. Edges between a module and its own ancestor (a
child reading its parent's items, a parent its child's) are left out: they are how Rust
nests modules, not a circle of separate parts. Prints the number of modules and edges, each
strongly connected set of two or more modules (a circle), and with --edges every edge.
Exit status 0 either way: it reports, it does not judge.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b(crate|super|self|[a-z_][a-z0-9_]*)((?:::[a-z_][a-z0-9_]*)+)")


def modules(src: Path) -> dict[str, Path]:
    """Module path (`a::b`) -> file."""
    out = {}
    for f in sorted(src.rglob("*.rs")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "mod":
            parts.pop()
        if parts in (["lib"], ["main"]):
            parts = []
        out["::".join(parts) or "crate"] = f
    return out


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def uses(mod: str, text: str, mods: dict[str, Path]) -> set[str]:
    here = [] if mod == "crate" else mod.split("::")
    found = set()
    # `use a::{b, c::d}` groups: enough to look at the head path of each `use`.
    for m in PATH.finditer(text):
        head, tail = m.group(1), m.group(2).split("::")[1:]
        if head == "crate":
            base = []
        elif head in ("super", "self"):
            base = list(here)
            if head == "super":
                base = base[:-1]
            while tail and tail[0] == "super":
                base, tail = base[:-1], tail[1:]
        elif "::".join(here + [head]) in mods:
            base, tail = list(here), [head] + tail
        else:
            continue
        path = base + tail
        while path and "::".join(path) not in mods:
            path.pop()
        target = "::".join(path) or "crate"
        if target != mod:
            found.add(target)
    return found


def related(a: str, b: str) -> bool:
    """One is the other's ancestor (`crate` is everyone's)."""
    if "crate" in (a, b):
        return True
    return a.startswith(b + "::") or b.startswith(a + "::")


def sccs(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src = Path(args[0] if args else "crates/sandlot-node/src")
    mods = modules(src)
    edges = {
        m: {t for t in uses(m, strip_comments(f.read_text()), mods) if not related(m, t)}
        for m, f in mods.items()
    }
    count = sum(len(v) for v in edges.values())
    print(f"{len(mods)} modules, {count} edges (ancestor/descendant edges left out)")
    if "--edges" in sys.argv:
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f"  {m} -> {t}")
    circles = [c for c in sccs(sorted(mods), edges) if len(c) > 1]
    if not circles:
        print("no circles")
    for c in circles:
        print(f"circle of {len(c)}: {', '.join(c)}")


if __name__ == "__main__":
    main()
