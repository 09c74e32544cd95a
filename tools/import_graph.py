"""The import graph of the flashdl package: its modules, who imports whom (at module level or
inside a function), the import circles (groups of modules that reach each other), private names
(_name) one module takes from another, and the largest files. Exits 1 on a circle, such a private
import or a file over MAX_LINES (tools/lint.sh runs it).

    python tools/import_graph.py [python/flashdl] [-v]
"""

from __future__ import annotations

import ast
import pathlib
import sys


MAX_LINES = 800  # DESIGN.md: small files, one concern each


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def analyse(root: pathlib.Path):
    mods = {p.stem: p for p in sorted(root.glob("*.py"))}
    edges: dict[tuple[str, str], str] = {}  # (importer, imported) -> "top" or "function"
    taken = []  # (importer, source, private name)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        in_function = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
        aliases = {}  # local name -> flashdl module
        for node in ast.walk(tree):
            targets = []  # (module, name imported from it or None)
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module is None:
                    targets = [(a.name, None) for a in node.names]
                    aliases.update({a.asname or a.name: a.name for a in node.names})
                else:
                    targets = [(node.module.split(".")[0], a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "flashdl":
                targets = [(a.name, None) if a.name in mods else ("__init__", a.name)
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashdl."):
                targets = [(node.module.split(".")[1], a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("flashdl."):
                        targets.append((a.name.split(".")[1], None))
                        if a.asname:
                            aliases[a.asname] = a.name.split(".")[1]
            for mod, item in targets:
                if mod not in mods or mod == name:
                    continue
                kind = "function" if id(node) in in_function else "top"
                if edges.get((name, mod)) != "top":
                    edges[(name, mod)] = kind
                if item and private(item):
                    taken.append((name, mod, item))
        for node in ast.walk(tree):  # module._name
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and private(node.attr)):
                taken.append((name, aliases[node.value.id], node.attr))
    return mods, edges, taken


def circles(mods, edges):
    """Strongly connected groups of more than one module (Tarjan)."""
    graph = {m: [b for (a, b) in edges if a == m] for m in mods}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(group) > 1:
                found.append(sorted(group))

    for m in mods:
        if m not in index:
            visit(m)
    return found


def main(argv):
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    root = pathlib.Path(args[0] if args else pathlib.Path(__file__).parents[1] / "python/flashdl")
    mods, edges, taken = analyse(root)
    found = circles(mods, edges)
    late = sorted(e for e, kind in edges.items() if kind == "function")
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in mods.items()), reverse=True)
    print(f"{len(mods)} modules, {len(edges)} import edges, {len(late)} inside functions"
          + "".join(f"\n  {a} -> {b}" for a, b in late))
    print(f"{len(found)} import circles" + "".join(f"\n  {' <-> '.join(g)}" for g in found))
    print(f"{len(taken)} private names taken from another module"
          + "".join(f"\n  {a}: {b}.{n}" for a, b, n in sorted(set(taken))))
    print("largest files: " + ", ".join(f"{m}.py {n}" for n, m in sizes[: 5 if not verbose else None]))
    long = [f"{m}.py ({n} lines)" for n, m in sizes if n > MAX_LINES]
    if long:
        print(f"over {MAX_LINES} lines: " + ", ".join(long))
    return 1 if found or taken or long else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
