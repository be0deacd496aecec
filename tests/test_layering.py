"""The floors of the code (procs/DESIGN.md, "Layers"), read from every module's imports with `ast`:

- `shared/` imports neither `procs/` nor `kernels/`; `kernels/` does not import `procs/`.
- A process package (`procs/api`, `tokenizer`, `scheduler`, `worker`, `detokenizer`) imports no other
  process package: processes meet only through `shared/` (messages, sockets, shared memory). From the
  rest of `procs/` it may use only the process support modules, which import no process package.
- No cycle among the imports that run (all but those under `if TYPE_CHECKING:`, which only type
  checkers follow).
- No module of these floors over 500 lines, no function over 60.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERED = ("procs", "kernels", "shared")
PROCESS_PACKAGES = frozenset({"api", "tokenizer", "scheduler", "worker", "detokenizer"})
# What every process runs on (`ProcessRuntime`), and the error type of the CLI's subcommands.
PROCESS_SUPPORT = frozenset({"batchserve.procs.runtime", "batchserve.procs.cli"})


@dataclass(frozen=True)
class Import:
    importer: str
    module: str
    line: int
    at_runtime: bool  # not under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["batchserve", *(parts[:-1] if parts[-1] == "__init__" else parts)])


MODULES: dict[str, Path] = {module_name(p): p for top in LAYERED for p in sorted((ROOT / top).rglob("*.py"))}


def _resolve(name: str, attribute: str | None) -> str | None:
    """The project module an import names (`from a import b` names a.b when that is a module)."""
    if attribute is not None and f"{name}.{attribute}" in MODULES:
        return f"{name}.{attribute}"
    return name if name in MODULES else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statement_imports(module: str, node: ast.stmt, runs: bool) -> list[Import]:
    """The imports of one statement, looking into every nested block (function bodies included)."""
    if isinstance(node, ast.Import):
        found = [_resolve(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        found = [_resolve(base, a.name) for a in node.names]
    else:
        found = []
    result = [Import(module, m, node.lineno, runs) for m in found if m is not None]
    for field, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for child in children:
            if not isinstance(child, ast.stmt):
                continue
            typing_only = isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test)
            result.extend(_statement_imports(module, child, runs and not typing_only))
    return result


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    return [imp for node in tree.body for imp in _statement_imports(module, node, True)]


IMPORTS = [imp for module in MODULES for imp in imports_of(module)]


def _process_package(module: str) -> str | None:
    parts = module.split(".")[1:]  # without the leading "batchserve"
    return parts[1] if parts[0] == "procs" and len(parts) > 1 and parts[1] in PROCESS_PACKAGES else None


def _breaks_floor(imp: Import) -> bool:
    top, target = imp.importer.split(".")[1], imp.module.split(".")[1]
    if top == "shared":
        return target != "shared"
    if top == "kernels":
        return target == "procs"
    if imp.importer in PROCESS_SUPPORT:
        return _process_package(imp.module) is not None
    package = _process_package(imp.importer)
    if package is None or target != "procs":
        return False
    return _process_package(imp.module) != package and imp.module not in PROCESS_SUPPORT


def test_the_scan_sees_the_project():
    assert {
        "batchserve.shared.messages",
        "batchserve.kernels.attention",
        "batchserve.procs.scheduler.core",
        "batchserve.procs.api.app",
    } <= set(MODULES)
    assert any(
        imp.importer == "batchserve.procs.api.app" and imp.module == "batchserve.shared.config" for imp in IMPORTS
    )


def test_no_import_reaches_up_or_across_processes():
    broken = [f"{imp.importer} imports {imp.module} (line {imp.line})" for imp in IMPORTS if _breaks_floor(imp)]
    assert broken == []


@pytest.mark.parametrize(
    "importer,module,expected",
    [
        ("batchserve.shared.config", "batchserve.procs.launch", True),
        ("batchserve.shared.config", "batchserve.kernels.native", True),
        ("batchserve.kernels.attention.base", "batchserve.procs.worker.kv_cache", True),
        ("batchserve.procs.tokenizer.process", "batchserve.procs.scheduler.core", True),
        ("batchserve.procs.api.engine_client_zmq", "batchserve.procs.launch", True),
        ("batchserve.procs.runtime", "batchserve.procs.worker.process", True),
        ("batchserve.procs.worker.model_runner", "batchserve.kernels.attention", False),
        ("batchserve.procs.tokenizer.process", "batchserve.procs.runtime", False),
        ("batchserve.procs.serve", "batchserve.procs.scheduler.core", False),
    ],
)
def test_the_floor_rule_itself(importer, module, expected):
    assert _breaks_floor(Import(importer, module, 1, True)) is expected


def test_no_import_cycle():
    """Counting the imports inside functions too: a cycle closed by a late import is still a cycle."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if imp.at_runtime and imp.module != imp.importer:
            graph[imp.importer].add(imp.module)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert [" -> ".join(c) for c in cycles] == []


# The team's size limits (the brief's habits): small pieces that can be read whole.
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_no_module_over_500_lines_and_no_function_over_60():
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name} (line {node.lineno}): {lines} lines")
    assert too_long == []
