"""The import graph of the package: imports run one way, and no import circle exists.

Read from the source (``ast``), not by importing, so a forbidden edge is caught even on a path
no test executes (a CUDA-only branch, a lazy import inside a function). Rules (DESIGN.md):

- module-level imports form no cycle (``if TYPE_CHECKING`` ones count: a type-only import
  circle is the same knot for a reader; imports inside functions are deliberate deferrals and
  do not);
- nothing imports ``traind.daemon.node``, the composition root, except the CLI that starts it;
- the trainer and the kernels run in worker processes: no web framework, database or
  Prometheus client there, and nothing of the daemon, the web layer or the CLI;
- the web layer never imports trainer internals; metrics never do either (the types both sides
  of the worker boundary share live in ``traind.contracts``, which imports nothing of traind's
  but itself, and no torch);
- the CLI has no database engine and no web imports;
- the web routers never import each other (any import, in a function too): what two of them
  share lives in a module of ``traind.web`` beside them, and only ``traind.web.app`` imports
  the routers;
- SQL lives in ``traind.daemon.db`` (every query) and ``traind.migrations``: nothing else
  imports SQLAlchemy or Alembic, except ``sqlalchemy.Engine`` under ``if TYPE_CHECKING`` to
  annotate the engine it is handed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "bench", "docs", "docker", ".venv", ".lint", "build", "traind.egg-info"}


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the imported module (a traind submodule, or a third-party top-level name)
    line: int
    module_level: bool
    name: str = ""  # what the statement names: ``sqlalchemy.Engine`` for from-imports
    type_checking: bool = False  # inside an ``if TYPE_CHECKING:`` block (annotations only)

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("traind", *parts))


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0] in SKIP or any(p.startswith(".") for p in rel):
            continue
        found[module_name(path)] = path
    return found


def resolve(name: str, known: dict[str, Path]) -> str:
    """The longest known module that ``name`` (``a.b.c``, maybe ``module.attribute``) is in."""
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def edges(known: dict[str, Path]) -> list[Edge]:
    out = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        top_level = {id(n) for n in _module_level(tree.body)}
        typing_only = _type_checking(tree)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package upwards
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name, known) if name.startswith("traind") else name.split(".")[0]
                if target != mod:
                    out.append(Edge(mod, target, node.lineno, id(node) in top_level, name,
                                    id(node) in typing_only))
    return out


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import: the body, and the bodies of its ifs and trys."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _module_level(stmt.body) + _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _module_level(stmt.body) + _module_level(stmt.orelse)
            for h in stmt.handlers:
                out += _module_level(h.body)
            out += _module_level(stmt.finalbody)
    return out


def _type_checking(tree: ast.Module) -> set[int]:
    """The nodes inside the body of an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


KNOWN = modules()
EDGES = edges(KNOWN)


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_graph_is_read() -> None:
    # a walker that found nothing would pass every rule below
    assert "traind.trainer.loop" in KNOWN and "traind.web.app" in KNOWN
    assert any(e.target == "torch" for e in EDGES if e.source == "traind.trainer.loop")


def test_type_checking_imports_are_told_apart() -> None:
    # the sql rule lets these through: a walker that marked none (or all) would be wrong
    promotions = {e.name: e.type_checking for e in EDGES
                  if e.source == "traind.daemon.promotions" and e.target == "sqlalchemy"}
    assert promotions == {"sqlalchemy.Engine": True}
    assert not any(e.type_checking for e in EDGES if e.source == "traind.daemon.db.queue")


def test_every_package_is_installed() -> None:
    # pyproject lists the packages by hand (the root is the package): a new folder left out
    # imports in the editable checkout and is missing from a wheel or the Docker image
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    packages = {m for m, p in KNOWN.items() if p.name == "__init__.py"}
    assert packages == listed


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in KNOWN}
    for e in EDGES:
        if e.module_level and e.target in KNOWN:
            graph[e.source].add(e.target)
    cycles = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                # a package's __init__ importing its own submodule is the package, not a knot
                cycle = [*stack[stack.index(n):], n]
                if not all(within(c, cycle[0]) or within(cycle[0], c) for c in cycle):
                    cycles.append(" -> ".join(cycle))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


WORKER_FORBIDDEN = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic",
                    "prometheus_client")


def _node(e: Edge) -> bool:
    return e.target == "traind.daemon.node" and not within(e.source, "traind.cli")


def _worker(e: Edge) -> bool:
    return within(e.source, "traind.trainer", "traind.kernels") and (
        e.target in WORKER_FORBIDDEN
        or within(e.target, "traind.daemon", "traind.web", "traind.cli", "traind.metrics"))


def _web(e: Edge) -> bool:
    return within(e.source, "traind.web") and within(e.target, "traind.trainer")


def _metrics(e: Edge) -> bool:
    return within(e.source, "traind.metrics") and within(e.target, "traind.trainer")


def _contracts(e: Edge) -> bool:
    return within(e.source, "traind.contracts") and (
        e.target == "torch"
        or (e.target.startswith("traind") and not within(e.target, "traind.contracts")))


def _cli(e: Edge) -> bool:
    return within(e.source, "traind.cli") and e.module_level and (
        e.target in ("sqlalchemy", "fastapi", "uvicorn")
        or within(e.target, "traind.daemon.db", "traind.web"))


def _routes(e: Edge) -> bool:
    # traind.web.routes itself (the package) may import its submodules
    return within(e.target, "traind.web.routes") and e.source not in (
        "traind.web.app", "traind.web.routes")


def _sql(e: Edge) -> bool:
    """SQLAlchemy (and Alembic) only in ``traind.daemon.db`` and ``traind.migrations``, at
    module level or inside a function alike: everything else calls ``daemon/db``'s queries,
    which hand back plain values and frozen views. The one exception is
    ``sqlalchemy.Engine`` under ``if TYPE_CHECKING``: the runners and services annotate the
    engine the node hands them, and never use it but to pass it to a query."""
    return e.target in ("sqlalchemy", "alembic") and not within(
        e.source, "traind.daemon.db", "traind.migrations") and not (
        e.type_checking and e.name == "sqlalchemy.Engine")


RULES = {"node": _node, "worker": _worker, "web": _web, "metrics": _metrics,
         "contracts": _contracts, "cli": _cli, "routes": _routes, "sql": _sql}


@pytest.mark.parametrize("rule", list(RULES))
def test_imports_run_one_way(rule: str) -> None:
    bad = sorted({f"{e.source} -> {e.target}" for e in EDGES if RULES[rule](e)})
    assert not bad, f"forbidden imports ({rule}):\n" + "\n".join(bad)
