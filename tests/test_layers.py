"""The package's layers: every import in src/batchinfer points down a layer or across one, and
no packages import each other around a circle.

`LAYERS` is the one statement of the order (docs/architecture.md shows it as a table, and a
test here keeps the two equal). Imports are read with `ast` from every module: at module level
and inside functions (a lazy import is an arrow too), `import batchinfer.x` and `from
batchinfer.x import y` alike, relative ones resolved. Within a package, the imports that run
at import time must not form a circle between its modules (lazy ones may).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TOP = "batchinfer"

# Lowest first. A package may import its own layer and the ones below, never one above; within
# a layer, never around a circle. The root `batchinfer/__init__.py` is the public facade (it
# re-exports `LLM` lazily) and stands outside the layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("runner", "models", "native"),
    ("engine", "batching"),
    ("server", "batch", "integrations", "bench"),
    ("cli",),
)
LAYER_OF = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module, "batchinfer.batch.offline"
    target: str  # the module imported, "batchinfer.server.app"
    path: Path
    line: int
    at_import_time: bool  # False inside a function or under `if TYPE_CHECKING:`

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.target}"


def package_of(module: str) -> str | None:
    """`batchinfer.runner.backends.prefill` -> "runner"; None for the root facade."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@functools.cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's `__init__`), for every module."""
    found = {}
    for path in sorted((SRC / TOP).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def owner(name: str) -> str:
    """The module a dotted name lives in: itself, or the longest existing prefix."""
    while name not in modules() and "." in name:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def root_exports() -> dict[str, str]:
    """Names the root facade takes from a module (`LLM` -> `batchinfer.engine.llm`), so that
    `from batchinfer import LLM` counts as the import of the module behind it."""
    tree = ast.parse(modules()[TOP][0].read_text())
    return {alias.asname or alias.name: node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            for alias in node.names}


def targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The batchinfer modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            if node.level - 1 >= len(here):
                raise AssertionError(f"{module}: a relative import above the package")
            stem = here[:len(here) - (node.level - 1)]
            base = ".".join(stem + ([node.module] if node.module else []))
        names = []
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in modules():
                names.append(full)  # `from batchinfer import native`: the subpackage
            elif base == TOP and alias.name in root_exports():
                names.append(root_exports()[alias.name])
            else:
                names.append(base)
    return list(dict.fromkeys(owner(name) for name in names
                              if name == TOP or name.startswith(TOP + ".")))


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, is_package: bool) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.extend(Import(module, target, path, node.lineno, at_import_time)
                         for target in targets(module, is_package, node) if target != module)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import_time = False
        for child in ast.iter_child_nodes(node):
            runs_now = at_import_time and not (
                isinstance(node, ast.If) and is_type_checking(node.test) and child in node.body)
            visit(child, runs_now)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    return tuple(found for module, (path, is_package) in modules().items()
                 for found in imports_of(module, path, is_package))


def cycles(edges: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """One shortest circle (its nodes, the first repeated at the end) per strongly connected
    group of `edges` (node -> successor -> the imports that make the arrow)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graphs here are small
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = {node}
            while (member := stack.pop()) != node:
                group.add(member)
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    found = []
    for group in groups:
        start = min(group)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:  # breadth first, inside the group, back to `start`
            node = queue.popleft()
            if start in edges.get(node, {}):
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                found.append([*reversed(path), start])
                break
            for succ in sorted(edges.get(node, {})):
                if succ in group and succ not in came_from and succ != start:
                    came_from[succ] = node
                    queue.append(succ)
    return sorted(found)


def describe(cycle: list[str], edges: dict[str, dict[str, list[Import]]]) -> str:
    lines = [" -> ".join(cycle)]
    for source, target in zip(cycle, cycle[1:], strict=False):
        lines.append(f"  {source} -> {target}:")
        lines.extend(f"    {found.where}" for found in edges[source][target])
    return "\n".join(lines)


def package_edges() -> dict[str, dict[str, list[Import]]]:
    edges: dict[str, dict[str, list[Import]]] = {}
    for found in all_imports():
        source, target = package_of(found.source), package_of(found.target)
        if source is not None and target is not None and source != target:
            edges.setdefault(source, {}).setdefault(target, []).append(found)
    return edges


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module) for module in modules()} - {None}
    assert packages == set(LAYER_OF), (
        f"packages without a layer in LAYERS: {sorted(packages - set(LAYER_OF))}; "
        f"layers naming no package: {sorted(set(LAYER_OF) - packages)}")


def test_no_import_points_up_a_layer() -> None:
    upward = []
    for found in all_imports():
        source, target = package_of(found.source), package_of(found.target)
        if source is None or target is None:
            continue
        if LAYER_OF[target] > LAYER_OF[source]:
            upward.append(f"{found.where}: {source}/ (layer {LAYER_OF[source]}) may not import "
                          f"{target}/ (layer {LAYER_OF[target]}, above it)")
    assert not upward, "imports against the layer order in LAYERS:\n" + "\n".join(upward)


def test_no_cycle_between_packages() -> None:
    edges = package_edges()
    found = cycles(edges)
    assert not found, "packages that import each other around a circle:\n" + "\n".join(
        describe(cycle, edges) for cycle in found)


def test_no_import_time_cycle_between_modules_of_a_package() -> None:
    edges: dict[str, dict[str, list[Import]]] = {}
    for found in all_imports():
        if found.at_import_time and package_of(found.source) == package_of(found.target):
            edges.setdefault(found.source, {}).setdefault(found.target, []).append(found)
    found_cycles = cycles(edges)
    assert not found_cycles, "modules that import each other at import time:\n" + "\n".join(
        describe(cycle, edges) for cycle in found_cycles)


def test_the_architecture_page_shows_the_same_layers() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)/` \|", section, flags=re.MULTILINE)
    documented = {package: int(rank) for rank, package in rows}
    assert documented == LAYER_OF, (
        "docs/architecture.md's layer table differs from LAYERS in tests/test_layers.py: "
        f"{documented} != {LAYER_OF}")


def test_the_checks_find_what_they_look_for() -> None:
    """The graph reader sees the arrows it must: relative, lazy and facade imports; the
    cycle finder names a circle once, whatever leads into it."""
    def named(module: str, is_package: bool, statement: str) -> list[str]:
        node = ast.parse(statement).body[0]
        assert isinstance(node, ast.Import | ast.ImportFrom)
        return targets(module, is_package, node)

    assert named("batchinfer.batch.offline", False, "from ..server import app") == [
        "batchinfer.server.app"]
    assert named("batchinfer.batch", True, "from .lines import peek") == ["batchinfer.batch.lines"]
    assert named("batchinfer.cli.main", False, "import batchinfer.server.app.build_app") == [
        "batchinfer.server.app"]
    assert named("batchinfer.cli.main", False, "from batchinfer import LLM, native") == [
        "batchinfer.engine.llm", "batchinfer.native"]
    source = "batchinfer.engine.llm_engine"
    lazy = [found for found in all_imports()
            if found.source == source and found.target == "batchinfer.runner.worker"]
    assert lazy and not lazy[0].at_import_time  # imported inside `from_config`
    via_facade = {found.target for found in all_imports() if found.source == "batchinfer"}
    assert "batchinfer.engine.llm" in via_facade
    edges = {"a": {"b": lazy}, "b": {"c": lazy}, "c": {"a": lazy}, "d": {"a": lazy}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
