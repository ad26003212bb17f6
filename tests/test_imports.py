"""diffspec's modules import each other without circles (function-local imports included: a lazy import
that closes a circle is still one). A circle fails here with its members named. The last one (the auto
policy timed its drafter by importing the engine that runs it; the compile and matmul-plan caches found
their keys in costs.py, which imported the compiled widths back) was broken by passing the engine's class
to `LengthPolicy.attach` and by moving the cache keys to machine_keys.py.
Edges are relative imports (`from .x import y`, what the package uses) to the module named; a package's
`__init__` that a submodule import runs first is not an edge here."""

import ast
import sys
from pathlib import Path

import diffspec

ROOT = Path(diffspec.__file__).parent


def import_graph() -> dict:
    def name(path: Path) -> str:
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    deps.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("diffspec."))
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_detector_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_circles():
    graph = import_graph()
    assert "diffspec.checkpoint" in graph and graph["diffspec.dflash_format"]  # the graph was read
    found = [sorted(c) for c in circles(graph)]
    assert not found, f"modules that import each other in a circle: {found}"


def test_the_auto_policy_does_not_import_the_engine_and_costs_do_not_import_policies():
    """The two edges whose removal broke the last circle stay removed."""
    graph = import_graph()
    assert "diffspec.engine" not in graph["diffspec.policies.auto"]
    assert not any(d.startswith("diffspec.policies") for d in graph["diffspec.costs"])
    assert "diffspec.costs" not in graph["diffspec.compiled"] and "diffspec.costs" not in graph["diffspec.kernels"]
