"""The package's structure holds: imports run downward through the layers that
docs/architecture.md lists (its ```layers block), no module imports itself back through a
circle, `tiny/` is reached only where a tiny model is asked for, and functions stay short.

Every import counts, also those inside functions (they hide a dependency, not remove it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "omnistage"
# Who may import the tiny-checkpoint builders, and only inside a function (on use).
TINY_IMPORTERS = {"omnistage.cli", "omnistage.entrypoints.model_source"}
MAX_FUNCTION_LINES = 60


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported omnistage module, whether the import sits inside a function) for every import
    statement of the module, each name resolved to the deepest module it names."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, id(node) in nested))
    return found


def documented_layers() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md must hold the layer order in a ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            layers.append(["omnistage" if n == "__init__" else f"omnistage.{n}"
                           for n in re.split(r"[,\s]+", line) if n])
    return layers


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer whose longest entry contains `module` (0 = top)."""
    best = None
    for i, entries in enumerate(layers):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > len(best[1]):
                    best = (i, entry)
    return None if best is None else best[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    files = module_files()
    return {m: imports_of(m, p, set(files)) for m, p in files.items()}


def test_every_module_has_a_layer(graph):
    layers = documented_layers()
    assert [m for m in graph if layer_of(m, layers) is None] == []


def test_imports_run_downward(graph):
    layers = documented_layers()
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t, _ in targets
              if layer_of(t, layers) < layer_of(m, layers)]
    assert upward == [], "imports from a lower layer to a higher one"


def test_no_import_circles(graph):
    circles = strongly_connected(graph)
    assert circles == [], f"modules that import each other, directly or around a circle: {circles}"


def test_tiny_is_imported_only_on_use(graph):
    bad = [f"{m} (inside a function: {inner})" for m, targets in graph.items()
           if not m.startswith("omnistage.tiny") for t, inner in targets
           if t.startswith("omnistage.tiny") and (m not in TINY_IMPORTERS or not inner)]
    assert bad == []


def test_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_checks_see_what_they_check():
    """The parser resolves relative, nested and package imports, and the circle search finds
    a circle: the tests above cannot pass by seeing nothing."""
    files = module_files()
    engine = dict(imports_of("omnistage.llm.engine", files["omnistage.llm.engine"], set(files)))
    assert "omnistage.llm.scheduler" in engine and engine["omnistage.llm.scheduler"] is False
    source = dict(imports_of("omnistage.entrypoints.model_source",
                             files["omnistage.entrypoints.model_source"], set(files)))
    assert source.get("omnistage.tiny") is True
    assert strongly_connected({"a": [("b", True)], "b": [("c", False)], "c": [("a", False)]}) \
        == [["a", "b", "c"]]
    layers = documented_layers()
    assert layer_of("omnistage.server.app", layers) < layer_of("omnistage.llm.engine", layers) \
        < layer_of("omnistage.layers.linear", layers) < layer_of("omnistage.errors", layers)


def strongly_connected(graph: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the groups of two or more modules on a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(t for t, _ in graph.get(root, [])))]
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
                    work.append((child, iter(t for t, _ in graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles
