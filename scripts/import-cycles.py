#!/usr/bin/env python3
"""Lists the top-level modules of a crate's src/ that import each other in a circle.

    python3 scripts/import-cycles.py [SRC_DIR]    # default: src

A module depends on another when its code (comments and #[cfg(test)] parts left out) names
`crate::<other>`. Prints each module's dependencies, then the strongly connected groups of more
than one module (import circles), and exits 1 if there is any.
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "src"
deps = {}
for dirpath, _, files in os.walk(root):
    for f in files:
        if not f.endswith(".rs"):
            continue
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, root)[:-3].replace("/mod", "").replace(os.sep, "::")
        top = "crate" if rel == "lib" else rel.split("::")[0]
        code = "\n".join(l for l in open(path).read().split("\n") if not l.strip().startswith("//"))
        code = code.split("#[cfg(test)]")[0]
        found = {m.group(1) for m in re.finditer(r"crate::([a-z_]+)", code)}
        deps.setdefault(top, set()).update(d for d in found if d != top)
graph = {k: {d for d in v if d in deps} for k, v in deps.items()}
for k in sorted(graph):
    print(f"{k} -> {', '.join(sorted(graph[k])) or '-'}")

index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while True:
            w = stack.pop()
            on.discard(w)
            group.append(w)
            if w == v:
                break
        groups.append(sorted(group))
for v in sorted(graph):
    if v not in index:
        visit(v)
circles = [g for g in groups if len(g) > 1]
print("import circles:", "; ".join(" <-> ".join(g) for g in circles) if circles else "none")
sys.exit(1 if circles else 0)
