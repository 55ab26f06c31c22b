"""The package's shape: no import cycle, modules of one screenful or so, each saying its job.

Read from the source with :mod:`ast`, so nothing is imported and the tests take milliseconds.
Every import counts, at the top of a module, inside a function or under ``TYPE_CHECKING``:
a cycle hidden in a function is still two modules that cannot be read one after the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mgtutor"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mgtutor modules that ``name`` imports (a package's ``__init__`` for its names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            # A module importing its own package's __init__ is how Python loads it anyway.
            if target in modules and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each mgtutor module and the mgtutor modules it imports."""
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a longer loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_find_cycles_finds_a_loop_of_three_and_no_loop_in_a_chain() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_imports_inside_functions_and_under_type_checking() -> None:
    graph = import_graph()
    # _cleanup names RankHandle only for type hints; _processes imports a module in a function.
    assert "mgtutor.launcher._rank" in graph["mgtutor.launcher._processes"]
    assert "mgtutor.measure.memory" in graph["mgtutor.hardware"]


def test_no_module_of_mgtutor_imports_itself_round_a_loop() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_is_at_most_about_a_screenful_and_says_its_job() -> None:
    long, silent = [], []
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{name} ({lines} lines)")
        if not ast.get_docstring(ast.parse(path.read_text())):
            silent.append(name)
    assert not long, f"over {MAX_LINES} lines: {', '.join(long)}"
    assert not silent, f"no docstring saying the module's job: {', '.join(silent)}"


def test_every_folder_of_mgtutor_has_a_folder_of_tests() -> None:
    tests = Path(__file__).resolve().parent
    folders = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    missing = [name for name in folders if not (tests / name / "__init__.py").exists()]
    assert not missing, f"tests/ has no folder for mgtutor/{', mgtutor/'.join(missing)}"
