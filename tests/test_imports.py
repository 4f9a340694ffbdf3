"""Layers point down: no import circle between multilora's packages (and top-level modules), and
every arrow goes from a higher layer to a lower one. Imports are read with ast, those inside
functions included (a lazy import is still an arrow). And no module grows past 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "multilora"

# Highest first. A unit may import units of lower layers only; units of one layer not each other.
LAYERS = [
    {"__main__"},
    {"cli"},
    {"server"},
    {"engine"},
    {"adapters"},
    {"model"},
    {"lora"},
    {"kernels"},
    {"demo_adapters"},
    {"config", "default_model"},
    {"rope_scaling"},
    {"errors"},
]


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """`multilora.engine.runner` -> "engine"; `multilora` itself -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "multilora" and len(parts) > 1 else None


def imports_of(path: Path) -> set[str]:
    """The multilora modules a file imports (from-imports of names resolved to their module, or to
    the submodule when the name is one)."""
    tree = ast.parse(path.read_text())
    here = module_of(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # a relative import starts from the file's package
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.update(f"{mod}.{a.name}" if mod == "multilora" else mod for a in node.names)
    return {m for m in out if m == "multilora" or m.startswith("multilora.")}


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        src = unit_of(module_of(path))
        if src is None:  # multilora/__init__.py: the package's lazy façade (Engine, SamplingParams)
            continue
        for mod in imports_of(path):
            dst = unit_of(mod)
            if dst is not None and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def test_no_import_circle_between_packages():
    graph = unit_graph()
    # Tarjan-free: a unit is on a circle when it reaches itself.
    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            u = todo.pop()
            if u not in seen:
                seen.add(u)
                todo.extend(graph.get(u, ()))
        return seen
    circles = sorted(u for u in graph if u in reaches(u))
    assert not circles, f"packages on an import circle: {circles} ({ {u: sorted(graph[u]) for u in circles} })"


def test_every_import_points_down_the_layers():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    graph = unit_graph()
    unknown = sorted(set(graph) - set(layer))
    assert not unknown, f"units in no layer (add them to LAYERS): {unknown}"
    up = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if layer[dst] <= layer[src])
    assert not up, f"imports that point up or sideways: {up}"


def test_no_module_over_600_lines():
    """A file over ~600 lines is a sign to split (docs/design.md, "Layout")."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
