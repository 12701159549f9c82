"""The package's shape, checked from its source: layers, import cycles, aioquic, mixins,
the root, the programs.

docs/architecture.md's rules, made tests so a change that breaks one fails here and not in a
review: imports point downward only and form no cycle (``TYPE_CHECKING`` imports count, as
they tie the modules together for a reader and for the type checker just the same); only the
transport and security layers import aioquic; a class is never assembled from mixins
spread over files; the package root holds the public surface's modules and nothing else;
the programs use the public surface only; no module only names another's definitions again.
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
    "eventlog": 0,
    "recordpath": 0,
    "security": 1,
    "transport": 2,
    "discovery": 3,
    "messenger": 4,
    "streaming": 5,
    "mux": 6,
    "config": 7,
    "node": 7,
    "ops": 7,
    "tracing": 7,
    "__init__": 8,
    "programs": 9,
    "__main__": 9,
}
"""Each top-level module or subpackage and its height: a module imports only from layers
below it or from its own (the root ``__init__`` re-exports the public surface, and the
programs are built on it)."""

ROOT_MODULES = {"__init__", "errors", "ids", "node", "config", "__main__"}
"""The modules at the package root: the public surface's, and ``__main__`` (``python -m
velomux_quic``, the command), nothing else."""

PUBLIC_SURFACE = {
    "velomux_quic",
    "velomux_quic.errors",
    "velomux_quic.ids",
    "velomux_quic.node",
    "velomux_quic.config",
    "velomux_quic.security",
}
"""What a program may import of the library: the root (whose ``__all__`` is the contract),
its public modules, and the certificate toolkit the security package exports (its
``__init__``, not its modules)."""

NODE_LAYERS = {"messenger", "anchors", "mux"}
"""A node's layers: outside the contract, so no program reads them."""

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


ENGINE_ADAPTERS = {
    "aioquic": {"velomux_quic.transport.aioquic_engine", "velomux_quic.security.tls"},
    "qh3": {"velomux_quic.transport.qh3_engine", "velomux_quic.security.qh3_tls"},
}
"""The only modules that import each QUIC engine: a node loads the other engine's adapter
only if it chooses that engine (``tests/integration/test_qh3_without_aioquic.py`` runs a
qh3 node with aioquic impossible to import)."""


def test_only_an_engines_adapters_import_it() -> None:
    importers = {
        engine: sorted(
            name
            for name, path in modules().items()
            if any(target.split(".")[0] == engine for target in imported(name, path))
        )
        for engine in ENGINE_ADAPTERS
    }
    assert importers == {engine: sorted(names) for engine, names in ENGINE_ADAPTERS.items()}


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
    "velomux_quic.mux.channel.MuxChannel": (
        "a mux channel is a whole channel; its base only declares ``try_send``, so that "
        "compiled, the sender's loops call it as a C method"
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


def test_the_package_root_holds_only_the_public_surface() -> None:
    at_root = {path.stem for path in PACKAGE_DIR.glob("*.py")}
    assert at_root == ROOT_MODULES
    packages = {path.parent.name for path in PACKAGE_DIR.glob("*/__init__.py")}
    assert set(LAYERS) == ROOT_MODULES | packages, "every package has a height"


def test_the_node_configuration_builds_no_discovery_backend() -> None:
    """config.py is the node's configuration only: the backends, and the code that builds
    one from ``[discovery]``, are the discovery package's."""
    tree = ast.parse((PACKAGE_DIR / "config.py").read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }  # fmt: skip
    assert names & {"StaticPeers", "DirectoryPeers", "EtcdPeers", "backend_for"} == set()


def program_modules() -> dict[str, Path]:
    return {name: path for name, path in modules().items() if layer_of(name) == "programs"}


def test_the_programs_import_only_the_public_surface() -> None:
    known = modules()
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in program_modules().items()
        for target in imported(name, path)
        if target in known and target not in PUBLIC_SURFACE and layer_of(target) != "programs"
    )
    assert offenders == []


def reaches_into_a_node(expression: ast.Attribute) -> bool:
    """``node.messenger``, ``self.node.mux``, ``node._closed``: a node's layers or private
    state read through a name that holds a node."""
    owner = expression.value
    holder = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
    if holder != "node":
        return False
    attribute = expression.attr
    return attribute in NODE_LAYERS or (attribute.startswith("_") and not attribute.endswith("__"))


def test_the_programs_never_reach_into_a_node() -> None:
    offenders = sorted(
        f"{name}:{node.lineno} {ast.unparse(node)}"
        for name, path in program_modules().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and reaches_into_a_node(node)
    )
    assert offenders == []


def test_the_reach_check_sees_what_it_must() -> None:
    """The check above, proven on the shapes it is for (a check that never fires would pass
    on anything)."""

    def flagged(text: str) -> bool:
        tree = ast.parse(text, mode="eval")
        return any(
            isinstance(node, ast.Attribute) and reaches_into_a_node(node) for node in ast.walk(tree)
        )

    assert flagged("node.messenger.transport.credentials")
    assert flagged("self.node.mux is not None")
    assert flagged("node._closed")
    assert not flagged("node.snapshot().mux is not None")
    assert not flagged("node.peers.get(peer)")


def only_renames(tree: ast.Module) -> bool:
    """A module whose body is a docstring, imports and ``__all__``: it defines nothing."""
    for statement in tree.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(statement, ast.Assign) and [ast.unparse(t) for t in statement.targets] == [
            "__all__"
        ]:
            continue
        return False
    return True


def test_no_module_only_names_definitions_of_another() -> None:
    """A package's ``__init__`` gathers its API; any other module that only imports names
    again is a second place to find them (the tree of errors lives in errors.py alone)."""
    offenders = sorted(
        name
        for name, path in modules().items()
        if path.name != "__init__.py" and only_renames(ast.parse(path.read_text()))
    )
    assert offenders == []
