"""The package's imports only point down the layers, and no modules import each other in a circle.

Measured from the code itself: every module under ``infera/`` is parsed with ``ast`` (no import is
run). The layers, top to bottom (docs/architecture.md):

    up, gaie, operator, preflight -> server -> router, engine -> transport
        -> kvd, discovery, api -> kv, config, runtime

A module may import its own layer or one below: any import, at module level or inside a function
or under ``if TYPE_CHECKING:``. Circles count the imports that run: at module level and inside
functions (a lazy import hides a circle, it does not break it: both circles of issue 34 went
through one); only those under ``if TYPE_CHECKING:`` (the type checker's) are left out.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import infera

PACKAGE = Path(infera.__file__).resolve().parent
ROOT = PACKAGE.parent

# Each name at the top of infera/ (a subpackage or a module) and its layer: higher imports lower.
LAYERS: dict[str, int] = {
    # entry points that start or configure the rest: the dev launcher, the Gateway API picker,
    # the Kubernetes operator, the node report
    "up": 5, "gaie": 5, "operator": 5, "preflight": 5,
    "server": 4,
    "router": 3, "engine": 3,
    "transport": 2,
    "kvd": 1, "discovery": 1, "api": 1,
    "kv": 0, "config": 0, "runtime": 0, "heap_trim": 0,
    "__init__": 0,  # the package itself (``import infera``: the version)
}


@dataclass(frozen=True)
class Import:
    source: Path  # the importing file
    line: int
    target: str  # the module (or package) imported, dotted
    when: str  # "import": runs when the importer is imported; "call": inside a function; "typing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = all_modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The infera modules an import statement loads (a name imported from a module is that module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the importing module's package, up level-1 packages
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        # ``from package import submodule`` loads the submodule; ``from module import name`` the module
        out.append(sub if sub in MODULES else base)
    return out


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(node, field, []) for field in ("body", "orelse", "finalbody")]
    blocks += [holder.body for holder in getattr(node, "handlers", []) + getattr(node, "cases", [])]
    return blocks


def imports_of(path: Path, importer: str | None = None) -> list[Import]:
    importer = importer or module_name(path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], when: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, importer, is_package):
                    if target == "infera" or target.startswith("infera."):
                        found.append(Import(path, node.lineno, target, when))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "typing" if when == "typing" else "call")  # runs when called
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "typing")  # for the type checker only
                visit(node.orelse, when)
            else:  # the blocks of if/try/with/for/match/class run when their surroundings do
                for block in _blocks(node):
                    visit(block, when)

    visit(ast.parse(path.read_text(), filename=str(path)).body, "import")
    return found


ALL_IMPORTS = [imp for path in MODULES.values() for imp in imports_of(path)]


def layer_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def where(imp: Import) -> str:
    return f"{imp.source.relative_to(ROOT)}:{imp.line}"


# -- the table is complete -------------------------------------------------------------------------

def test_every_top_level_name_has_a_layer():
    on_disk = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk - LAYERS.keys() == set(), "give these a layer in LAYERS"
    assert LAYERS.keys() - on_disk == set(), "these are in LAYERS but not under infera/"


@pytest.mark.parametrize("source, target, expected", [
    # (what an import statement resolves to, so that the checks below see what Python loads)
    ("from infera.router.policy import Policy", "infera.router.policy", "a name: its module"),
    ("from infera.router import policy", "infera.router.policy", "a submodule"),
    ("import infera.kv.hashing as h", "infera.kv.hashing", "a dotted import"),
    ("from .schemas import ApiError", "infera.engine.sim.schemas", "relative"),
    ("from . import tool_calls", "infera.engine.sim.tool_calls", "relative submodule"),
    ("from ..base import launcher", "infera.engine.base.launcher", "two levels up"),
])
def test_import_resolution(source, target, expected):
    node = ast.parse(source).body[0]
    assert _targets(node, "infera.engine.sim.server", False) == [target], expected


@pytest.mark.parametrize("source, when", [
    ("import infera.kv", "import"),
    ("try:\n    import infera.kv\nexcept ImportError:\n    pass", "import"),
    ("class C:\n    import infera.kv", "import"),
    ("def f():\n    import infera.kv", "call"),
    ("class C:\n    async def f(self):\n        if x:\n            import infera.kv", "call"),
    ("if TYPE_CHECKING:\n    import infera.kv", "typing"),
    ("if typing.TYPE_CHECKING:\n    import infera.kv\nelse:\n    import infera.config", "typing"),
    ("if TYPE_CHECKING:\n    def f():\n        import infera.kv", "typing"),
])
def test_when_an_import_runs(tmp_path, source, when):
    module = tmp_path / "m.py"
    module.write_text(source)
    found = {(i.target, i.when) for i in imports_of(module, "infera.m")}
    assert ("infera.kv", when) in found and len({w for t, w in found if t == "infera.kv"}) == 1


# -- (a) layers --------------------------------------------------------------------------------------

def test_no_import_climbs_a_layer():
    climbs: dict[str, None] = {}  # (one line for a statement that imports several names)
    for imp in ALL_IMPORTS:
        source_layer, target_layer = layer_name(module_name(imp.source)), layer_name(imp.target)
        if LAYERS[target_layer] > LAYERS[source_layer]:
            climbs[f"{where(imp)}: {source_layer} (layer {LAYERS[source_layer]}) imports {imp.target} "
                   f"({target_layer}, layer {LAYERS[target_layer]})"] = None
    if climbs:
        pytest.fail("imports that climb up the layers:\n  " + "\n  ".join(climbs), pytrace=False)


# -- (b) circles -------------------------------------------------------------------------------------

def module_graph() -> dict[str, dict[str, Import]]:
    """importer → {imported module: the first import of it that runs}, infera modules only."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in MODULES}
    for imp in sorted(ALL_IMPORTS, key=lambda i: i.when != "import"):  # (a module-level one first)
        importer = module_name(imp.source)
        if imp.when != "typing" and imp.target in MODULES and imp.target != importer:
            graph[importer].setdefault(imp.target, imp)
    return graph


def circles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
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
                    work.append((child, iter(sorted(graph[child]))))
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
                    out.append(sorted(component))
    return out


def test_circle_finder_finds_circles():
    def edge(target):
        return Import(Path("x.py"), 1, target, "import")

    graph = {"a": {"b": edge("b")}, "b": {"c": edge("c")}, "c": {"a": edge("a")}, "d": {"a": edge("a")}, "e": {}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b": edge("b")}, "b": {}}) == []


def test_no_import_circles():
    graph = module_graph()
    found = circles(graph)
    described = []
    for component in found:
        members = set(component)
        edges = [f"{where(imp)}: {src} imports {dst}" + (" (inside a function)" if imp.when == "call" else "")
                 for src in component for dst, imp in sorted(graph[src].items()) if dst in members]
        described.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    if found:
        pytest.fail("modules that import each other:\n  " + "\n  ".join(described), pytrace=False)


# -- the interfaces that keep the layers apart ---------------------------------------------------

def test_server_metrics_implements_every_router_metric():
    """ServerMetrics declares RouterMetrics (the router records through it without importing the
    server): each method must be its own, with the protocol's parameters, or a call would fall
    through to the protocol's empty body and record nothing."""
    import inspect

    from infera.router.metrics import RouterMetrics
    from infera.server.metrics import ServerMetrics

    methods = [n for n, v in vars(RouterMetrics).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert methods
    for name in methods:
        assert name in vars(ServerMetrics), f"ServerMetrics.{name} is missing"
        assert (list(inspect.signature(getattr(ServerMetrics, name)).parameters)
                == list(inspect.signature(getattr(RouterMetrics, name)).parameters)), name
