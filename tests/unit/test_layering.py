"""The package's shape, checked from its source: layers, import cycles, aioquic, mixins.

ARCHITECTURE.md's rules, made tests so a change that breaks one fails here and not in a
review: imports point downward only and form no cycle (``TYPE_CHECKING`` imports count, as
they tie the modules together for a reader and for the type checker just the same); only the
transport and security layers import aioquic; a class is never assembled from mixins
spread over files.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import velomux_quic

PACKAGE_DIR = Path(velomux_quic.__file__).parent
PACKAGE = "velomux_quic"

LAYERS = {
    "ids": 0,
    "errors": 0,
    "runtime": 0,
    "recordpath": 0,
    "security": 1,
    "transport": 2,
    "messenger": 3,
    "streaming": 4,
    "mux": 5,
    "config": 6,
    "node": 6,
    "ops": 6,
    "snapshot": 6,
    "demo": 7,
    "cli": 7,
    "service": 7,
    "probe": 7,
    "__init__": 8,
}
"""Each top-level module or subpackage and its height: a module imports only from layers
below it or from its own (the root ``__init__`` re-exports everything)."""

AIOQUIC_LAYERS = {"transport", "security"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def imported(name: str, path: Path) -> Iterator[str]:
    """Every module of the package (or aioquic) that ``name`` imports, at any depth of the
    file (inside functions and ``if TYPE_CHECKING:`` blocks too)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target
            for alias in node.names:  # ``from . import x`` names a module
                yield f"{target}.{alias.name}"


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        edges[name] = {
            target for target in imported(name, path) if target in known and target != name
        }
    return edges


def layer_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_outside_transport_and_security_imports_aioquic() -> None:
    offenders = sorted(
        name
        for name, path in modules().items()
        if layer_of(name) not in AIOQUIC_LAYERS
        and any(target.split(".")[0] == "aioquic" for target in imported(name, path))
    )
    assert offenders == []


def test_imports_point_downward() -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if LAYERS[layer_of(target)] > LAYERS[layer_of(name)]
    )
    assert upward == []


def test_no_import_cycle_not_even_under_type_checking() -> None:
    edges = graph()
    # Tarjan's strongly connected components; any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    # A package's __init__ re-exporting its own modules is not a cycle of logic: drop the
    # edges from a package to its own submodules before judging.
    real = [
        cycle
        for cycle in cycles
        if not all(member == cycle[0] or member.startswith(cycle[0] + ".") for member in cycle)
    ]
    assert real == []


SPECIALISATIONS: dict[str, str] = {
    "velomux_quic.mux.binds.BindBook": (
        "the node's bind book is the in-memory bind registry (used alone by the ingress "
        "tests and simple embeddings) plus accept-window deadlines and lane loads"
    ),
    "velomux_quic.transport.perstream_send.PerStreamOutbound": (
        "a per-stream path stream is a lane's outbound stream (used alone for every lane) "
        "whose admission also counts the connection's shared per-stream backlog"
    ),
}
"""Classes that extend a concrete class of another module on purpose, with the reason:
each is a whole object of its own, not a share of one class's state and methods."""


def resolved_bases(name: str, path: Path) -> Iterator[tuple[str, str, str]]:
    """(class, base module, base class) for every base of a class in ``name`` that is a
    class of the package, resolved through the module's own imports."""
    tree = ast.parse(path.read_text(), str(path))
    origin = import_origins(name, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base_expr in node.bases:
                base_name = ast.unparse(base_expr)
                if base_name in origin and origin[base_name][0].startswith(PACKAGE):
                    yield node.name, *origin[base_name]


def defining_class(
    module: str, name: str, known: dict[str, Path], depth: int = 0
) -> tuple[str, ast.ClassDef] | None:
    """Where class ``name`` seen in ``module`` is defined, following re-exports."""
    if module not in known or depth > 5:
        return None
    tree = ast.parse(known[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for _, base_module, base_name in (
        (None, *origin)
        for alias, origin in import_origins(module, known[module]).items()
        if alias == name
    ):
        return defining_class(base_module, base_name, known, depth + 1)
    return None


def import_origins(name: str, path: Path) -> dict[str, tuple[str, str]]:
    """What each name imported by ``from ... import`` in ``name`` refers to."""
    is_package = path.name == "__init__.py"
    origin: dict[str, tuple[str, str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                origin[alias.asname or alias.name] = (target, alias.name)
    return origin


def test_no_class_is_assembled_from_mixins_in_other_files() -> None:
    """A package class may derive from a package class of another module only when that
    base is an interface (a Protocol, or a handler class whose methods are all meant to be
    overridden) or an exception of the one tree; never to borrow another file's state and
    methods."""
    known = modules()
    offenders = []
    for name, path in known.items():
        for cls, base_module, base_name in resolved_bases(name, path):
            if base_module == f"{PACKAGE}.errors" or base_module not in known:
                continue
            found = defining_class(base_module, base_name, known)
            if found is None:
                continue
            base_module, base = found
            if base_module == f"{PACKAGE}.errors":
                continue
            if {ast.unparse(b) for b in base.bases} & {"Protocol"} or base_name.endswith("Handler"):
                continue
            if f"{name}.{cls}" in SPECIALISATIONS:
                continue
            offenders.append(f"{name}.{cls}({base_module}.{base_name})")
    assert sorted(offenders) == []
