"""The layering of the code base (docs/design.md §2), read from the source.

Every import of the project's own modules counts, at module level and inside functions
(a function-level import is still an arrow: it only hides it from the interpreter's
start-up). Two rules:

* an arrow may point only to the importer's own layer or to one the layer may use
  (``ALLOWED`` below, lowest layer first): the pure core imports nothing above it, the
  data plane neither serving nor deployment, and so on;
* there is no circle, neither between modules nor between layers. Imports under
  ``if TYPE_CHECKING:`` (annotations only) count too: two modules that name each
  other's types are tangled even if neither needs the other to load. Where one part
  only uses another through a few methods, it names a ``Protocol`` of its own instead
  (``core/transaction.py`` ``RequestLedger``, ``core/replication.py`` ``ReplicaStore``,
  ``deploy/ray/compute.py`` ``ComputeActorSource``).

The test parses files; it imports nothing of the project, so it also holds for code that
needs torch, zmq or Ray.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenlake", "query_engine", "transfer_engine", "scheduler", "evals")

#: (layer, module prefixes), lowest first; the longest matching prefix decides.
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("tokenlake.core",),
    # The attention math and the native kernels' bindings: tensors in, tensors out
    "kernels": ("tokenlake.kernels",),
    "dataplane": ("tokenlake.dataplane",),
    "model": ("tokenlake.model",),
    # The query, transfer and compute engines; the top-level packages are their entry
    # points under the names of docs/design.md
    "engines": ("tokenlake.engines", "query_engine", "transfer_engine"),
    "scheduler": ("scheduler",),
    "generation": ("tokenlake.generation",),
    "deploy": ("tokenlake.deploy",),
    "service": ("tokenlake.service",),
    "evals": ("evals",),
    "tools": ("tokenlake.tools",),
    # Other frameworks on the pool (vLLM's connector), and the model export they load
    "integrations": ("tokenlake.integrations",),
    # The package itself (tokenlake/__init__.py): the version, and tokenlake.connect
    # loaded from the service on first use.
    "package": ("tokenlake",),
}

_ENGINES = {"core", "kernels", "dataplane", "model", "engines"}

#: The layers each layer may import besides itself.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core"},
    "dataplane": {"core", "kernels"},  # the client merges the partials it receives
    "model": {"core", "kernels"},
    "engines": _ENGINES - {"engines"},
    "scheduler": {"core"},
    "generation": _ENGINES | {"scheduler"},
    "deploy": _ENGINES | {"scheduler", "generation"},
    "service": _ENGINES | {"scheduler", "generation", "deploy"},
    "evals": _ENGINES | {"scheduler", "generation", "deploy", "service"},
    "integrations": _ENGINES | {"service"},
    "tools": _ENGINES | {"scheduler", "generation", "deploy", "service", "evals", "package",
                         "integrations"},
    "package": {"core", "service"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(path: Path, modules: set[str]) -> Iterator[tuple[str, int, bool]]:
    """``(imported project module, line, annotations only)`` for every import in the
    file, at any depth."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import mod" imports the module pkg.mod when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # "import a.b.c" of a name inside a.b
                name = name.rpartition(".")[0]
            if name and name != me:
                yield name, node.lineno, id(node) in typing_only


def import_graph() -> nx.DiGraph:
    files = {module_name(p): p for p in project_files()}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for target, line, typing_only in imports_of(path, set(files)):
            if graph.has_edge(module, target):  # a real import wins over an annotation
                typing_only = typing_only and graph.edges[module, target]["typing_only"]
            graph.add_edge(module, target, line=line, typing_only=typing_only)
    return graph


GRAPH = import_graph()


def test_the_graph_is_read():
    """Sanity: the parser sees imports we know exist (a broken reader would pass all)."""
    assert GRAPH.has_edge("tokenlake.core.control", "tokenlake.core.pool")
    assert GRAPH.has_edge("tokenlake.deploy.local", "tokenlake.dataplane.client")
    assert GRAPH.has_edge("scheduler.goodput", "scheduler.api")
    assert GRAPH.number_of_nodes() > 80


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


def test_no_import_runs_up():
    wrong = []
    for src, dst, data in GRAPH.edges(data=True):
        a, b = layer_of(src), layer_of(dst)
        if a != b and b not in ALLOWED[a]:
            wrong.append(f"{src} (line {data['line']}, layer {a}) imports {dst} (layer {b})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_circle_between_modules():
    cycles = list(nx.simple_cycles(GRAPH))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_no_circle_between_layers():
    layers = nx.DiGraph()
    layers.add_edges_from((layer_of(a), layer_of(b)) for a, b in GRAPH.edges if
                          layer_of(a) != layer_of(b))
    assert nx.is_directed_acyclic_graph(layers), list(nx.simple_cycles(layers))


@pytest.mark.parametrize("src,dst", [
    ("tokenlake.core.control", "tokenlake.dataplane.wire"),
    ("tokenlake.dataplane.client", "tokenlake.deploy.local"),
    ("tokenlake.kernels.attention", "tokenlake.dataplane.wire"),
    ("tokenlake.model.llama.model", "tokenlake.engines.compute"),
    ("tokenlake.core.pool", "tokenlake.tools.cli"),
    ("scheduler.api", "tokenlake.generation.loop"),
])
def test_the_rules_catch_an_upward_arrow(src, dst):
    """The rules themselves: each of these arrows would be refused."""
    assert layer_of(dst) not in ALLOWED[layer_of(src)]
