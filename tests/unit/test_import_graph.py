"""ddrl's import graph, folder by folder: no circle across folders, and rewards never import tasks.

The graph is read from the source with `ast`, so it sees what a run may not: imports inside
functions, imports under `if TYPE_CHECKING:` (a type named across folders is a dependency too), and
module names written as strings (`importlib.import_module("ddrl.x")`, lazy-export tables), which is
how a cycle hides from Python's import machinery. A node is a folder of ddrl/ (cli, training, eval,
sampling, tasks, rewards, ...) or a top-level module (config, data, types, registry, ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DDRL = Path(__file__).resolve().parents[2] / "ddrl"
MODULE_NAME = re.compile(r"ddrl(\.\w+)+")  # a string that spells a ddrl module ("ddrl.tasks.presets")

# The registry is the one hub that names every layer: `_ensure_builtins_loaded` imports the built-in
# layers by name so that a lookup finds them before anyone imported them. Every layer imports the
# registry to register itself; the registry's loading of them is not a dependency of its own.
PLUGIN_LOADER = "registry"

# Edges a circle may keep for now, each with the issue that removes it. None: config checks a rollout
# section through the registry (SAMPLERS.get(name).settings), never by importing ddrl.sampling.
KNOWN_EDGES: set[tuple[str, str]] = set()


def _layer(module: str) -> str | None:
    """The node of a dotted module name under ddrl ("ddrl.sampling.masked" -> "sampling"), None for ddrl itself."""
    parts = module.split(".")
    if parts[0] != "ddrl" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (DDRL / name).is_dir() or (DDRL / f"{name}.py").is_file() else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(DDRL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted module, line) of every ddrl module the file names: import statements anywhere, and string
    constants that spell a ddrl module."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y` inside package p is p.x
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.append((base, node.lineno))
            if base == "ddrl":  # `from ddrl import config` names a module
                out += [(f"ddrl.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            out.append((node.value, node.lineno))
    return out


def import_graph() -> dict[str, dict[str, list[str]]]:
    """edges[a][b]: the "module:line" places where folder a imports folder b (a != b)."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(DDRL.rglob("*.py")):
        module = _module_name(path)
        source = _layer(module)
        if source is None:
            continue
        for target, line in _imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            dest = _layer(target)
            if dest is None or dest == source:
                continue
            if source == PLUGIN_LOADER and target in _loaded_by_name(path):
                continue
            edges.setdefault(source, {}).setdefault(dest, []).append(f"{module}:{line}")
    return edges


def _loaded_by_name(path: Path) -> set[str]:
    """The modules a file loads by name (string constants), as opposed to import statements."""
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and MODULE_NAME.fullmatch(n.value)}


def circles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            visit(v)
    return found


def _describe(edges: dict[str, dict[str, list[str]]], component: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(edges[a][b][:3])}" for a in component for b in component
                     if b in edges.get(a, {}))


def test_circles_finds_a_circle_and_only_circles():
    edges = {"a": {"b": ["x:1"]}, "b": {"c": ["y:2"]}, "c": {"a": ["z:3"]}, "d": {"a": ["w:4"]}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b": []}, "b": {"c": []}}) == []


def test_the_graph_sees_lazy_type_only_and_string_imports():
    tree = ast.parse("def f():\n    from ddrl.tasks import base\nif TYPE_CHECKING:\n    import ddrl.config\n"
                     "MODULES = ('ddrl.sampling',)\nfrom . import masked\n")
    names = [m for m, _ in _imported(tree, "ddrl.rewards.x", is_package=False)]
    assert sorted(names) == ["ddrl.config", "ddrl.rewards", "ddrl.sampling", "ddrl.tasks"]


def test_no_circle_across_folders():
    edges = import_graph()
    assert "training" in edges and "rewards" in edges.get("tasks", {}), "the graph must see ddrl's real imports"
    for a, b in KNOWN_EDGES:
        assert b in edges.get(a, {}), f"known exception {a} -> {b} is gone: remove it from KNOWN_EDGES"
    kept = {a: {b: where for b, where in targets.items() if (a, b) not in KNOWN_EDGES} for a, targets in edges.items()}
    found = circles(kept)
    assert not found, "import circles across folders:\n" + "\n\n".join(_describe(kept, c) for c in found)


def test_rewards_never_import_tasks():
    offending = import_graph().get("rewards", {}).get("tasks", [])
    assert not offending, f"rewards import tasks at {offending}; a preset (prompt + reward + metric) belongs in " \
                          f"ddrl/tasks/presets/, the reward functions it uses in ddrl/rewards/"
