"""The import structure: no circles among chat_api, memory and indexer, and a domain that stays one.

Read from the source, not by importing it: every `import` and `from … import` counts,
also the ones deferred into a function body; only imports under `if TYPE_CHECKING:`
(annotations, never run) do not. `from package import name` counts as an import of
`package.name` when that is a module, else of the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chat_api", "memory", "indexer")
# What the domain (memory/) never imports.
NOT_IN_THE_DOMAIN = frozenset({"fastapi", "starlette", "sse_starlette", "aiokafka", "chat_api", "indexer"})


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    yield from _imports(node)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    named = {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in named if name in known} or {base}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of these packages it imports."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= {t for t in _targets(module, path, node, known) if t in known and t != module}
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_chat_api_memory_or_indexer_imports_itself_back() -> None:
    graph = import_graph()
    assert circles(graph) == []


def test_the_domain_imports_no_web_framework_no_kafka_and_nothing_of_chat_api_or_indexer() -> None:
    modules = _modules()
    for module, path in modules.items():
        if not module.startswith("memory"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top not in {
                    "fastapi",
                    "starlette",
                    "sse_starlette",
                    "aiokafka",
                    "chat_api",
                    "indexer",
                }, f"{module} imports {name}"


def test_the_circle_finder_finds_a_deferred_import_circle() -> None:
    """The check itself can fail: a deferred import back is a circle, a TYPE_CHECKING one is not."""
    a = ast.parse("def f():\n    import b\n")
    b = ast.parse("import a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import c\n")
    graph = {
        "a": {n.names[0].name for n in _imports(a)},
        "b": {n.names[0].name for n in _imports(b) if n.names[0].name != "TYPE_CHECKING"},
        "c": {"b"},
    }
    assert graph["b"] == {"a"}
    assert circles(graph) == [["a", "b"]]
