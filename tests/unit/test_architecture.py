"""Imports of draftline's own code go one way, down the layers below, with no cycle (docs/architecture.md).

The graph is read from platform/draftline with `ast`: every `import draftline...` and `from draftline... import`,
at module level and inside functions (an import under `if TYPE_CHECKING:` never runs and is not an edge). A module
belongs to the layer of its top-level package or module; command-line glue (`cli.py` anywhere, `commands/`) is the
top layer. An import of a module in a higher layer fails, as does a cycle between modules or between top-level
packages. A draftline module is imported at module top: inside a function only where ALLOWED_LAZY says why.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

PACKAGE_ROOT = REPO / "platform" / "draftline"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"utils", "faults", "wheels", "reaper", "records"}),
    ("config", {"config"}),
    ("services", {"tracking", "raycluster", "stagelog"}),  # MLflow, Ray and the console, which every stage uses
    ("target/data", {"target", "data"}),
    ("drafter", {"drafter"}),
    ("engines", {"engines"}),  # below regenerate: regenerating a dataset runs the target through an engine
    ("regenerate", {"regenerate"}),
    ("extract", {"extract"}),
    ("train", {"train"}),
    ("bench/gate", {"bench", "gate", "registry"}),
    ("serving", {"serving"}),
    ("release", {"release"}),  # a rollout: moves the registry's aliases and rolls serving
    ("pipeline", {"pipeline", "report"}),
    ("refresh", {"refresh"}),  # the pipeline's stages again, on captured traffic
    ("commands", {"cli", "commands", "__main__"}),  # __main__: `python -m draftline`, the CLI
]

# (importer, imported) -> why the import sits inside a function
ALLOWED_LAZY: dict[tuple[str, str], str] = {}
# Edges from a stage module to the command layer still waiting for their move (none now). An entry no import needs
# any more fails the test.
PENDING_CLI_GLUE: dict[str, set[str]] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    path: Path
    line: int
    lazy: bool

    def __str__(self) -> str:
        where = "inside a function" if self.lazy else "at module level"
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.importer} imports {self.imported} ({where})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def resolved(name: str, known: dict[str, Path]) -> str:
    """`from draftline.a import b`: module draftline.a.b when b is a module, else draftline.a."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def read_edges(known: dict[str, Path]) -> list[Edge]:
    edges = []
    for importer, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        edges += _edges_in(tree, importer, package, path, known)
    return edges


def _edges_in(tree: ast.AST, importer: str, package: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    edges = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in child.names]
            for name in names:
                if name.split(".")[0] == "draftline":
                    edges.append(Edge(importer, resolved(name, known), path, child.lineno, lazy))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return [edge for edge in edges if edge.imported != importer]


def unit_of(module: str) -> str:
    """The top-level package or module: draftline.engines.sglang.cli -> engines."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "draftline"


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[-1] == "cli" or unit_of(module) == "commands":
        return len(LAYERS) - 1
    if module == "draftline":
        return 0
    for index, (_, units) in enumerate(LAYERS):
        if unit_of(module) in units:
            return index
    raise AssertionError(f"{module}: its top-level name {unit_of(module)!r} is in no layer; add it to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycle_report(component: list[str], edges: list[Edge], key) -> str:
    members = set(component)
    inside = [str(edge) for edge in edges if key(edge.importer) in members and key(edge.imported) in members
              and key(edge.importer) != key(edge.imported)]
    return f"cycle {' <-> '.join(component)}:\n    " + "\n    ".join(sorted(set(inside)))


def pending(edge: Edge) -> bool:
    return edge.imported in PENDING_CLI_GLUE.get(edge.importer, ())


KNOWN = modules()
EDGES = read_edges(KNOWN)


def test_the_graph_is_read():
    """The reader sees module-level and function-level imports (a test of the test)."""
    assert len(KNOWN) > 50 and len(EDGES) > 200
    assert any(edge.importer == "draftline.cli" and edge.imported == "draftline.config" for edge in EDGES)
    lazy = ast.parse("def f():\n    from draftline.config import load_config\n")
    assert [edge.lazy for edge in _edges_in(lazy, "draftline.x", "draftline", PACKAGE_ROOT / "x.py", KNOWN)] == [True]


def test_every_import_goes_down_the_layers():
    upward = sorted({f"{edge}: layer {LAYERS[layer_of(edge.importer)][0]!r} imports layer "
                     f"{LAYERS[layer_of(edge.imported)][0]!r}"
                     for edge in EDGES if layer_of(edge.imported) > layer_of(edge.importer) and not pending(edge)})
    assert not upward, "imports up the layers (move the shared part down, or the caller up):\n" + "\n".join(upward)
    stale = [(importer, imported) for importer, names in PENDING_CLI_GLUE.items() for imported in names
             if not any(edge.importer == importer and edge.imported == imported for edge in EDGES)]
    assert not stale, f"PENDING_CLI_GLUE entries no import needs any more: {stale}"


def test_no_module_imports_itself_back():
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in EDGES:
        graph[edge.importer].add(edge.imported)
    found = cycles(graph)
    assert not found, "\n".join(cycle_report(component, EDGES, lambda m: m) for component in found)


def test_no_top_level_packages_import_each_other():
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in EDGES:
        if unit_of(edge.importer) != unit_of(edge.imported) and layer_of(edge.importer) < len(LAYERS) - 1:
            graph[unit_of(edge.importer)].add(unit_of(edge.imported))
    found = cycles(graph)
    assert not found, "\n".join(cycle_report(component, EDGES, unit_of) for component in found)


def test_draftline_modules_are_imported_at_module_top():
    lazy = sorted({str(edge) for edge in EDGES
                   if edge.lazy and (edge.importer, edge.imported) not in ALLOWED_LAZY and not pending(edge)})
    assert not lazy, "imports of draftline modules inside functions (move them to the top):\n" + "\n".join(lazy)
    stale = [pair for pair in ALLOWED_LAZY if not any((e.importer, e.imported) == pair and e.lazy for e in EDGES)]
    assert not stale, f"ALLOWED_LAZY entries no import needs any more: {stale}"
