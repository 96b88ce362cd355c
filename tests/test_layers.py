"""The package's folders are layers: imports only run down, and no module imports itself back in a circle.

The order is written once, here (docs/architecture.md shows it as a picture). Each
package may import the packages listed for it, and itself; every ``import`` in
the package counts, deferred ones inside functions included, since a deferred
import still couples the layers. ``TYPE_CHECKING`` imports are left out: they
run only under a type checker (``cpdata.gather`` names ``ShardLayout`` that way
so that importing it loads torch alone).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "cpdata"

# Low to high. A package may import only packages earlier in this list, and of those only the ones named.
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "__init__": {"errors"},  # the public names, imported lazily by name (errors.lazy_exports)
    "layout": {"errors"},
    "gather": {"layout"},
    "worker": {"errors", "layout"},
    "packing": {"errors", "layout", "worker"},
    "schedule": {"errors", "packing"},
    "sources": {"errors", "worker"},
    "nodes": {"errors", "layout", "worker", "packing", "schedule", "sources"},
    "offline": {"errors", "layout", "worker", "packing", "schedule", "sources", "nodes"},
    "device": {"errors", "layout", "gather", "worker"},  # the native path: a worker batch moved, attention, checks
    "nemo": {"errors", "layout", "gather", "worker", "device"},  # NeMo's sharder contract, above the native path
    "adapters": {"errors", "layout", "gather", "worker", "device"},
    "integrations": {"errors", "layout", "gather", "worker", "packing", "schedule", "sources", "nodes", "offline",
                     "device", "nemo", "adapters"},  # fmt: skip
    "recipes": {"errors", "layout", "worker", "packing", "schedule", "sources", "nodes", "offline", "device"},
    "bench": {"errors", "layout", "gather", "worker", "packing", "schedule", "sources", "nodes", "offline", "device",
              "nemo", "adapters", "recipes"},  # fmt: skip
    "cli": {"__init__"},
}
ROOT_MODULES = {"__init__", "cli", "errors", "gather"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The cpdata modules ``name`` imports (outside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block)
            for stmt in block.body for n in ast.walk(stmt)}  # fmt: skip
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_folder_has_a_layer_and_layers_only_name_lower_ones():
    order = list(LAYERS)
    for layer, allowed in LAYERS.items():
        higher = [a for a in allowed if order.index(a) >= order.index(layer)]
        assert not higher, f"layer {layer!r} may import {higher}, which are not below it in LAYERS"
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    files = {p.stem for p in ROOT.glob("*.py")}
    assert folders | files <= set(LAYERS), f"no layer for {sorted((folders | files) - set(LAYERS))}: add it to LAYERS"
    assert len(files) <= 6 and files == ROOT_MODULES, f"root modules: {sorted(files)}"


def test_imports_run_down_the_layers(graph):
    wrong = sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if _layer(dst) != _layer(src) and _layer(dst) not in LAYERS[_layer(src)]
    )
    assert not wrong, "imports from a lower layer up (or across) that LAYERS does not allow:\n" + "\n".join(wrong)
    assert sum(len(d) for d in graph.values()) > 200  # the graph was really read


def test_no_import_circles(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_each_package_docstring_says_its_role_and_lists_its_modules():
    bad = []
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__"))
        missing = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", doc)]
        if len(doc) < 200 or missing:
            bad.append(f"{init.parent.name}: {missing}")
    assert not bad, f"package docstrings must state the role and name every module: {bad}"
