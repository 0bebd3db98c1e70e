#!/usr/bin/env python3
"""Import cycles among the modules of a package, counting imports inside functions too.

    python tools/import_cycles.py [python/peagle]

Reads every ``.py`` file under the package with :mod:`ast` (nothing is imported or run), collects
every ``import`` / ``from ... import`` statement anywhere in the file (module level, functions,
``TYPE_CHECKING`` blocks), resolves relative imports, and maps each to the package module it
names (``from peagle.decode import engine`` counts as an import of ``peagle.decode.engine`` when
that module exists, else of ``peagle.decode``). Importing ``a.b.c`` also runs ``a`` and ``a.b``,
but a package's ``__init__`` is not counted as an edge of its submodules (that would make every
package that re-exports its submodules a cycle). Prints each strongly connected component of
more than one module (or a module importing itself) and exits 1 if there is any, else prints
``no import cycles (N modules)`` and exits 0.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under the package directory ``root``."""
    base = root.parent
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package modules that module ``name`` (file ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()

    def resolve(target: str) -> str | None:
        # The longest prefix of ``target`` that is a module of the package.
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in mods:
                return cand
        return None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                m = resolve(a.name)
                if m:
                    out.add(m)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                m = resolve(f"{base}.{a.name}") if a.name != "*" else None
                m = m or resolve(base)
                if m:
                    out.add(m)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    found.append(sorted(comp))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).parent.parent / "python" / "peagle")
    mods = module_names(root.resolve())
    graph = {}
    for name, path in mods.items():
        deps = imports_of(name, path, mods)
        # A package's own __init__ runs before its submodules: not an edge of theirs.
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    found = cycles(graph)
    for comp in found:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print("import cycle:", ", ".join(comp))
        for e in edges:
            print("   ", e)
    if found:
        return 1
    print(f"no import cycles ({len(mods)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
